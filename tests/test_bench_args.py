"""`k26 bench`'s arguments: --batch bounded by the KV cache rows the device can hold (refused in one line,
exit 2, before the prompts are drawn or anything loads), and the report's command reruns the bench with
every option it was given; bench / profile / info --startup flags checked before loading (--max-tokens
against the context, torchrun, an unused drafter, --cache-dir)."""

import re
import shlex

import pytest
import torch

import k26.bench
import k26.memory_plan
from k26.__main__ import main
from k26.bench import bench_command, check_batch
from k26.checks import default_max_model_len
from k26.cli_parser import build_parser
from k26.config import ModelConfig
from k26.drafter_config import DrafterConfig
from k26.embedded import default_drafter_dir, default_model_dir
from k26.kv_cache import DrafterCache, LatentCache

TARGET, DRAFTER = default_model_dir(), default_drafter_dir()


class _Loaded(Exception):
    """Raised by the stand-in LLM: the bench got past its argument checks to building a model."""


def _load(*a, **kw):
    raise _Loaded


def _allocated(rows: int) -> int:
    """Bytes of the caches LLM(max_batch=rows) allocates for the embedded pair, from real allocations."""
    cfg = ModelConfig.from_dir(TARGET)
    max_len = default_max_model_len(cfg)
    latent = LatentCache.allocate(cfg, rows, max_len, torch.bfloat16, "cpu").kv_LRTC
    d = DrafterCache.allocate(DrafterConfig.from_dir(DRAFTER), rows, max_len, torch.bfloat16, "cpu")
    return sum(t.numel() * t.element_size() for t in (latent, d.k, d.v))


def test_bench_batch_beyond_the_rows_memory_holds_is_refused_before_loading(monkeypatch, capsys):
    """Free memory for exactly 3 rows' caches: --batch 4 is refused in one line naming --batch, the value
    and the limit, with no prompts drawn and no model built; --batch 3 gets to building the model."""
    monkeypatch.setattr(k26.memory_plan, "free_memory", lambda dev: _allocated(3))
    monkeypatch.setattr(k26.bench, "LLM", _load)
    drawn = []
    prompts = k26.bench._prompts
    monkeypatch.setattr(k26.bench, "_prompts", lambda *a: drawn.append(a) or prompts(*a))
    assert main(["bench", "--device", "cpu", "--batch", "4", "--no-hf"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("k26: error: --batch 4: more rows than this machine can hold")
        and "Traceback" not in err
    )
    assert "the largest --batch that fits is 3" in err and len(err.strip().splitlines()) == 1 and not drawn
    with pytest.raises(_Loaded):
        main(["bench", "--device", "cpu", "--batch", "3", "--no-hf"])
    assert len(drawn) == 1


def test_bench_huge_batch_is_one_line_without_loading(monkeypatch, capsys):
    """The machine's own free memory: --batch 10**12 (petabytes of cache rows) exits 2 in one line."""
    monkeypatch.setattr(k26.bench, "LLM", _load)
    monkeypatch.setattr(
        k26.bench, "_prompts", lambda *a: pytest.fail("prompts drawn before --batch was checked")
    )
    assert main(["bench", "--device", "cpu", "--batch", str(10**12)]) == 2
    err = capsys.readouterr().err
    fit = re.fullmatch(
        r"k26: error: --batch 1000000000000: .* GiB free; the largest --batch that fits is (\d+)\n", err
    )
    assert fit and int(fit[1]) < 10**12


def test_bench_batch_limit_counts_both_llms_on_cuda(monkeypatch):
    """On CUDA the bench holds the eager and the graphs LLM at once: twice the caches per row."""
    monkeypatch.setattr(k26.memory_plan, "free_memory", lambda dev: 2 * _allocated(3))
    a = build_parser().parse_args(["bench", "--drafter", str(DRAFTER), "--batch", "4"])
    with pytest.raises(ValueError, match="--batch 4: more rows than the GPU can hold.* fits is 3$"):
        check_batch(a, TARGET, torch.device("cuda"))
    check_batch(a, TARGET, torch.device("cpu"))  # one LLM: 4 rows fit in the same bytes


def _recorded(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith("- command: `"))
    return shlex.split(line.removeprefix("- command: `").removesuffix("`"))


FLAGS = ["--model", str(TARGET), "--drafter", str(DRAFTER), "--device", "cpu", "--compile", "--no-hf"]


@pytest.mark.parametrize(
    "argv", [FLAGS + ["--batch", "2", "--max-tokens", "5", "--budget", "7"], ["--device", "cpu"], []]
)
def test_bench_report_command_has_every_flag_given(monkeypatch, capsys, tmp_path, argv):
    """The report's command (printed and written to --out) parses back to the arguments the bench ran with:
    every flag given (--model, --drafter, --device, --compile, --no-hf, ...), the device as resolved when
    none was given, not --out. The model runs are stand-ins: only the report is checked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (no --device: resolved to cpu)
    monkeypatch.setattr(k26.bench, "LLM", lambda *a, **kw: object())
    monkeypatch.setattr(k26.bench, "_timed_generate", lambda *a, **kw: (1.0, 1.0, None, []))
    monkeypatch.setattr(k26.bench, "_hf_baseline", lambda *a: 1.0)
    out_file = tmp_path / "report.md"
    assert main(["bench", *argv, "--out", str(out_file)]) == 0
    words = _recorded(capsys.readouterr().out)
    assert words[:4] == ["python", "-m", "k26", "bench"] and words == _recorded(out_file.read_text())
    assert all(w in words for w in argv) and "--device" in words and "--out" not in words
    rerun, given = build_parser().parse_args(words[3:]), build_parser().parse_args(["bench", *argv])
    assert vars(rerun) == {**vars(given), "device": "cpu", "out": None}


def test_bench_command_sets_the_kernel_environment_it_ran_with(monkeypatch):
    a = build_parser().parse_args(["bench", "--compile"])
    monkeypatch.delenv("K26_OPS_LIB", raising=False)
    monkeypatch.setenv("K26_OPS_DEFINES", "-DK26_A -DK26_B=2")
    words = shlex.split(bench_command(a, torch.device("cuda")))
    assert words[:2] == ["K26_OPS_DEFINES=-DK26_A -DK26_B=2", "python"] and "--compile" in words
    monkeypatch.delenv("K26_OPS_DEFINES")
    assert shlex.split(bench_command(a, torch.device("cuda")))[0] == "python"


def test_bench_and_profile_max_tokens_beyond_the_context_are_refused_before_loading(monkeypatch, capsys):
    """(Found in a bug hunt: bench --max-tokens 100 on a 64-token context reported "exactly 100 new tokens"
    of rows cut at 32; profile cut silently.) The room: the model's default context less the prompt."""
    monkeypatch.setattr(k26.bench, "LLM", _load)
    room = default_max_model_len(ModelConfig.from_dir(TARGET)) - k26.bench.PROMPT_TOKENS
    assert main(["bench", "--device", "cpu", "--no-hf", "--max-tokens", str(room + 1)]) == 2
    assert f"--max-tokens {room + 1}: its 32-token prompts leave room for {room}" in capsys.readouterr().err
    with pytest.raises(_Loaded):
        main(["bench", "--device", "cpu", "--no-hf", "--max-tokens", str(room)])
    out = ["--out", "/tmp/k26-unused.json"]
    assert main(["profile", "--device", "cpu", "--max-tokens", "10000000", *out]) == 2
    assert "--max-tokens 10000000: its 4-token prompts leave room for" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, said",
    [  # (found in a bug hunt)
        (["bench", "--no-hf"], "bench under torchrun: run it as one process"),
        (["profile", "--out", "/tmp/k26-unused.json"], "profile under torchrun: run it as one process"),
        (["info", "--startup"], "info --startup under torchrun: run it as one process"),
    ],
)
def test_bench_profile_and_info_startup_under_torchrun_are_refused(monkeypatch, capsys, argv, said):
    """Each rank ran its own whole bench (two reports into one --out, competing for the machine)."""
    monkeypatch.setattr(k26.bench, "LLM", _load)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*argv, "--device", "cpu"]) == 2
    out = capsys.readouterr()
    assert said in out.err and out.out == ""  # (info: before it prints the config)


def test_profile_with_a_drafter_but_ar_is_refused_before_loading(monkeypatch, capsys):
    """A drafter the default --spec ar would leave unused — and unchecked against the target."""
    from k26.cli_parser import AR_WITH_DRAFTER

    monkeypatch.setattr(k26.bench, "LLM", _load)
    out = ["--out", "/tmp/k26-unused.json"]
    assert main(["profile", "--drafter", str(DRAFTER), "--device", "cpu", *out]) == 2
    assert AR_WITH_DRAFTER in capsys.readouterr().err


def test_info_startup_checks_its_flags_before_printing(tmp_path, capsys):
    """--cache-dir naming a file was a warning after a whole start-up; the config printed before any check."""
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["info", "--startup", "--device", "cpu", "--cache-dir", str(f)]) == 2
    out = capsys.readouterr()
    assert "--cache-dir" in out.err and out.out == ""
