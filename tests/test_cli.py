"""The CLI as a first-time user meets it (issue 21 part 2): the README's command and sample, arguments
checked before any weights load, one line (never a traceback) for what a user can cause, small contexts,
`bench` on CPU, a truncated shard, `profile --spec ddtree` with phase ranges in its trace."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_support import DRAFTER, TARGET, run

import k26
from k26.__main__ import main
from k26.checks import fit_spec
from k26.profiling import nvtx_range

ROOT = Path(__file__).resolve().parents[1]


def k26_process(*argv: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "k26", *argv], cwd=ROOT, env=env, text=True, **kw)


# -- 2: the README's command prints the prompt, streams the continuation, and is the README's sample ------
def test_readme_sample_is_what_the_readme_command_prints(capsys):
    readme = (ROOT / "README.md").read_text()
    assert (
        "python -m k26 generate --prompt $'class Stack:\\n'" in readme.split("## Use")[0]
    )  # the main command
    sample = re.search(
        r"Sample: everything `python -m k26 generate --prompt \$'class Stack:\\n'`.*?```\n(.*?)```",
        readme,
        re.DOTALL,
    )
    assert sample, "README sample block not found"
    rc, out, err = run(capsys, "generate", "--prompt", "class Stack:\n")
    assert rc == 0 and out == sample.group(1)
    assert "ddtree" in err and "tau=" in err


def test_generate_echoes_the_prompt_and_streams_pieces(monkeypatch, capsys):
    writes = []
    real_write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: (writes.append(s), real_write(s))[1])
    rc = main(["generate", "--prompt", "def read(path):\n", "--max-tokens", "24", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("def read(path):\n") and len(out) > len("def read(path):\n")
    assert len([w for w in writes if w.strip()]) >= 3  # the prompt, then several increments, not one block


# -- 1: a small context works (smaller trees or AR, said once) or is refused up front ---------------------
@pytest.mark.parametrize(
    "max_len,said", [("16", "DDTree budgets limited to (3, 7)"), ("8", "decoding autoregressively")]
)
def test_small_context_decodes_and_says_how_once(capsys, max_len, said):
    # (no --max-tokens: the default is cut to the room the small context leaves; 4 no longer fits 8)
    rc, out, err = run(capsys, "generate", "--prompt", "def f(x):", "--max-model-len", max_len)
    assert rc == 0 and out.startswith("def f(x):")
    assert err.count(said) == 1 and "Traceback" not in err


def test_max_tokens_beyond_the_contexts_room_is_refused_and_the_default_fits_it(no_loading, capsys):
    """(Found in a bug hunt: --max-tokens 100000 with a 64-token context generated 61 and said finish_reason
    'length', where the server refuses such a request with a 400.)"""
    from k26.__main__ import plan_generate
    from k26.cli_parser import build_parser

    flags = ["generate", "--prompt", "def main(", "--max-model-len"]
    rc, _, err = run(capsys, *flags, "64", "--max-tokens", "100000")
    assert rc == 2 and "--max-tokens 100000: the prompt's" in err and "(--max-model-len)" in err
    a = build_parser().parse_args([*flags, "12", "--spec", "ar"])
    plan = plan_generate(a)
    assert plan.sampling.max_tokens == 12 - len(plan.prompt_ids)  # the default, cut to the room left
    a = build_parser().parse_args(["generate", "--prompt", "def main(", "--spec", "ar"])
    assert plan_generate(a).sampling.max_tokens == 64


def test_small_context_fixed_budget_is_refused_before_loading(no_loading, capsys):
    rc, _, err = run(capsys, "generate", "--prompt", "x", "--max-model-len", "12", "--budget", "12")
    assert (
        rc == 2 and "max_model_len=12 is too small for DDTree budget 12" in err and len(err.splitlines()) == 1
    )


def test_fit_spec_keeps_the_candidates_that_fit():
    auto = k26.SpecConfig(
        "ddtree", "auto", candidates=(3, 7, 15), costs=(0.0, 1.0, 2.0, 3.0), cost_per_token=(0, 0, 0)
    )
    assert fit_spec(auto, 4096, 8) is auto
    with pytest.warns(UserWarning, match="limited to"):
        cut = fit_spec(auto, 16, 8)
    assert cut.candidates == (3, 7) and cut.costs == (0.0, 1.0, 2.0) and cut.cost_per_token == (0, 0)
    with pytest.warns(UserWarning, match="autoregressively"):
        assert fit_spec(auto, 11, 8).method == "ar"
    assert fit_spec(k26.SpecConfig("ddtree", 4), 10, 8).budget == 4  # one step fits; later ones decode AR


# -- 3: every argument checked before the model loads ------------------------------------------------------
@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--temperature", "-1"], "--temperature -1.0: must be"),
        (["--top-p", "0"], "--top-p 0.0: must lie"),
        (["--top-k", "-2"], "--top-k -2: must be"),
        (["--max-tokens", "-1"], "--max-tokens -1: must be"),
        (["--budget", "0"], "--budget 0: expected 'auto' or an integer in [1, 255]"),
        (["--budget", "300"], "--budget 300: expected"),
        (["--spec", "dflash", "--budget", "3"], "--budget applies to --spec ddtree"),
        (["--spec", "ar", "--budget", "3"], "--budget applies to --spec ddtree"),
        (["--model", TARGET, "--spec", "ddtree"], "--spec ddtree needs --drafter DIR"),
        (["--model", TARGET, "--drafter", DRAFTER, "--spec", "ar"], "--drafter with --spec ar"),
        (["--model", "/nonexistent/k26"], "--model /nonexistent/k26: no such directory"),
        (["--model", TARGET + "/config.json"], f"pass the checkpoint directory that holds it: {TARGET}"),
        (["--drafter", TARGET + "/config.json"], f"pass the checkpoint directory that holds it: {TARGET}"),
        (["--model", DRAFTER], "model_type 'qwen3' is not supported"),  # a drafter is not a target
        (["--max-model-len", "999999"], "--max-model-len 999999: must lie in (1, "),
        (["--tp", "3"], "--tp 3: tensor-parallel size 3 does not divide"),
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "ab\udcffc"], "--prompt: text holds an unpaired UTF-16 surrogate"),  # (argv: 0xff)
        (["--prompt", "", "--chat"], "--prompt is empty"),
        (["--model", ""], "--model is empty: pass a checkpoint directory"),  # (not the current directory)
        (["--cache-dir", ""], "--cache-dir is empty"),
        (["--no-thinking"], "--no-thinking applies to --chat"),
        (["--prompt", "x " * 40, "--max-model-len", "32"], "leaving no room to generate"),
        (
            ["--cache-dir", TARGET + "/config.json"],
            "--cache-dir " + TARGET + "/config.json: exists and is not",
        ),
    ],
)
def test_bad_arguments_refused_before_loading(no_loading, capsys, argv, needle):
    argv = argv if "--prompt" in argv else [*argv, "--prompt", "hi"]
    rc, out, err = run(capsys, "generate", *argv)
    assert rc == 2 and needle in err and out == ""
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("extra,thinking", [([], True), (["--no-thinking"], False)])
def test_chat_prompt_is_the_models_chat_format(no_loading, extra, thinking):
    from k26.__main__ import parse_args, plan_generate
    from k26.chat import ChatFormat, Message, render

    plan = plan_generate(parse_args(["generate", "--prompt", "hi", "--chat", *extra]))
    fmt = ChatFormat.for_model("kimi_k25").with_thinking(thinking)  # the embedded target is K2.6-format
    assert plan.prompt_ids == render(k26.Tokenizer.from_dir(TARGET), [Message("user", "hi")], fmt)


@pytest.mark.parametrize("extra,stops", [([], None), (["--ignore-eos"], ())])
def test_ignore_eos_leaves_no_stop_id(no_loading, extra, stops):
    """`generate --ignore-eos`: no id ends the answer (None: the tokenizer's end ids do)."""
    from k26.__main__ import parse_args, plan_generate

    plan = plan_generate(parse_args(["generate", "--prompt", "hi", *extra]))
    assert plan.sampling.stop_token_ids == stops


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["bench", "--out", "/nonexistent/k26/bench.md"], "--out /nonexistent/k26/bench.md: directory"),
        (["profile", "--out", "/nonexistent/k26/t.json"], "--out /nonexistent/k26/t.json: directory"),
        (["profile", "--spec", "ar", "--budget", "4"], "--budget applies to --spec ddtree"),
        (["profile", "--model", TARGET, "--spec", "dflash"], "--spec dflash needs --drafter DIR"),
        (["bench", "--model", TARGET + "/config.json"], "is a file; pass the checkpoint directory"),
    ],
)
def test_bench_and_profile_arguments_refused_before_loading(monkeypatch, capsys, argv, needle):
    import k26.bench

    monkeypatch.setattr(k26.bench, "LLM", lambda *a, **kw: pytest.fail("the model was loaded"))
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_argparse_rejects_non_positive_context(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--max-model-len", "0"])
    assert e.value.code == 2 and "expected a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "abc"}, {"RANK": "abc"}, {"WORLD_SIZE": "0"}])
def test_a_torchrun_variable_that_is_no_count_is_one_line_naming_it(monkeypatch, capsys, no_loading, env):
    # (int()'s "invalid literal for int() with base 10: 'abc'" named neither the variable nor where it came
    # from; WORLD_SIZE=0 was blamed on a --tp 0 never passed)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, _, err = run(capsys, "generate", "--prompt", "hi")
    ((name, value),) = env.items()
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"k26: error: {name}={value!r} in the environment: expected an integer >=")


@pytest.mark.parametrize("env", [{"RANK": "5"}, {"RANK": "1", "WORLD_SIZE": "1"}])
def test_a_stale_rank_is_one_line_not_a_silent_run(monkeypatch, capsys, no_loading, env):
    # (found in an audit: RANK=5 left every line unprinted, rank 0's alone, and exited 0)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, out, err = run(capsys, "generate", "--prompt", "hi")
    assert rc == 2 and out == "" and err.startswith(f"k26: error: RANK={env['RANK']} in the environment")


def test_drafter_without_spec_decodes_with_ddtree(capsys):
    rc, _, err = run(
        capsys,
        "generate",
        "--model",
        TARGET,
        "--drafter",
        DRAFTER,
        "--prompt",
        "import os\n",
        "--max-tokens",
        "6",
    )
    assert rc == 0 and "ddtree" in err and "tau=" in err


# -- 4: no tracebacks ---------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(no_loading, capsys):
    rc, _, err = run(capsys, "generate", "--prompt", "x", "--device", "cuda")
    assert rc == 2 and "CUDA is not available" in err and len(err.splitlines()) == 1


def test_ctrl_c_exits_130_with_one_line():
    p = k26_process(
        "generate",
        "--prompt",
        "def f(x):",
        "--spec",
        "ar",
        "--max-tokens",
        "4000",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert (
            p.stdout.read(len("def f(x):")) == "def f(x):"
        )  # echoed once the model is loaded: generating now
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert (
        p.returncode == 130 and "Traceback" not in err and err.strip().splitlines()[-1] == "k26: interrupted"
    )


def test_closed_pipe_is_silent():
    p = k26_process("info", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # `| head` that has already left
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141 and err == ""


# -- 5: bench on CPU says what it skips and why ------------------------------------------------------------
def test_bench_on_cpu_lists_skips_and_no_zero_host_time(capsys):
    rc, out, _ = run(capsys, "bench", "--device", "cpu", "--max-tokens", "3", "--no-hf", "--budget", "4")
    assert rc == 0
    assert "skipped: CUDA-graph rows" in out and "skipped: HF transformers generate(): --no-hf" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "eager" in line]
    assert [r.split(" | ")[0] for r in rows] == [
        "| AR eager",
        "| DFlash eager",
        "| DDTree eager (budget 4)",
        "| DDTree eager (auto)",
    ]
    assert all(r.split(" | ")[3] == "—" for r in rows) and "nan" not in out  # host µs / step: eager has none
    assert re.search(r"\| \{4: \d+\} \|$", rows[2])  # the budget column: fixed budget 4 on every step


# -- 6: a truncated shard is one line ------------------------------------------------------------------------
def test_truncated_shard_is_one_line(tmp_path, capsys):
    d = tmp_path / "target"
    shutil.copytree(TARGET, d)
    shard = d / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    rc, _, err = run(capsys, "generate", "--model", str(d), "--prompt", "x", "--spec", "ar")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "shard model-00001-of-00002.safetensors is corrupt" in err and "truncated" in err


# -- 8: profile --spec ddtree with the embedded pair, phase ranges in the torch.profiler trace ------------
def test_profile_ddtree_without_model_has_phase_ranges(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    rc, _, err = run(capsys, "profile", "--spec", "ddtree", "--max-tokens", "3", "--out", str(trace))
    assert rc == 0, err
    names = {
        e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "user_annotation"
    }
    assert {"prefill", "draft", "tree", "verify", "accept"} <= names


def test_nvtx_range_shows_in_torch_profiler_only_while_recording(monkeypatch):
    from torch.profiler import profile

    with profile() as prof, nvtx_range("k26-phase"):
        torch.ones(4).sum()
    assert "k26-phase" in {e.name for e in prof.events()}
    import k26.profiling

    entered, real = [], k26.profiling.record_function
    monkeypatch.setattr(k26.profiling, "record_function", lambda name: entered.append(name) or real(name))
    with nvtx_range("outside"):  # no profiler: no record_function (~5 µs a call), nothing raised
        pass
    with profile(), nvtx_range("inside"):
        pass
    assert entered == ["inside"]


def test_bench_report_lists_every_captured_graph():
    """The graphs table of `k26 bench` has one row per capture record (bucket, seconds, pool MB): the
    record grew a field and the report unpacked three, which failed `k26 bench --compile` on the GPU."""
    from types import SimpleNamespace

    from k26.bench import _report
    from k26.graphs.buckets import Bucket
    from k26.startup import CaptureRecord

    recs = [
        CaptureRecord(Bucket(1, 16), 7.5, 33_600_000, "ddtree greedy"),
        CaptureRecord(Bucket(2, 1), 1.25, 0),
    ]
    graphs = SimpleNamespace(decoder=SimpleNamespace(runners={"a": SimpleNamespace(report=recs)}))
    a = SimpleNamespace(batch=1, max_tokens=8, budget=12, drafter="d", compile=True)
    rows = [("AR eager", 10.0, 1.0, None, "—"), ("DDTree graphs (auto)", 20.0, 2.5, 4e-5, "{7: 3, 15: 9}")]
    text = _report(a, Path("m"), torch.device("cpu"), rows, [], graphs, command="python -m k26 bench")
    assert "| (1, 16) | 7.50 | 33.6 |" in text and "| (2, 1) | 1.25 | 0.0 |" in text
    assert "| DDTree graphs (auto) | 20 | 2.50 | 40 | {7: 3, 15: 9} |" in text
