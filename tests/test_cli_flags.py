"""The CLI's start-up flags reaching the LLM it builds, and the checks `serve` and `generate` make before
loading (host, port, budget arguments, a failed graph capture as one line)."""

import pytest
from cli_support import TARGET, run

import k26
from k26.__main__ import main


class _Built(Exception):
    """Raised by `llm_kwargs`'s stand-in for LLM: the command got as far as building the model."""


@pytest.fixture
def llm_kwargs(monkeypatch) -> dict:
    """The keyword arguments a command builds its LLM with (the build itself stops with _Built)."""
    seen = {}

    def fake_llm(*args, **kw):
        seen.update(kw)
        raise _Built

    monkeypatch.setattr(k26, "LLM", fake_llm)
    # serve's default --port 8000 may be taken on the test machine: these tests are about the LLM's flags
    # (test_serve_port_taken_is_refused_before_loading tests the port check)
    monkeypatch.setattr(k26.__main__, "listen_arg", lambda host, port: None)
    return seen


def test_serve_start_up_flags_reach_the_llm(llm_kwargs, monkeypatch, tmp_path, capsys):
    """`serve --compile --cache-dir D --tp 2 --allreduce nccl` builds the LLM with them (checked before
    loading) and no start-up capture of its own (the engine's open batch captures what it serves); a
    --cache-dir that is a file is refused in one line before any loading."""
    with pytest.raises(_Built):
        main(
            [
                "serve",
                "--compile",
                "--cache-dir",
                str(tmp_path),
                "--tp",
                "2",
                "--allreduce",
                "nccl",
            ]
        )
    got = tuple(llm_kwargs.get(k, False) for k in ("compile", "capture", "cache_dir", "allreduce", "tp"))
    assert got == (True, False, str(tmp_path), "nccl", 2)
    (tmp_path / "f").write_text("x")
    monkeypatch.setattr(k26, "LLM", lambda *a, **kw: pytest.fail("loaded before --cache-dir was checked"))
    assert main(["serve", "--cache-dir", str(tmp_path / "f")]) == 2
    assert "--cache-dir" in capsys.readouterr().err
    # (found in a bug hunt: a directory below a file passed, and the load cache warned "not written" after
    # the whole load)
    assert main(["serve", "--cache-dir", str(tmp_path / "f" / "sub")]) == 2
    assert "--cache-dir" in capsys.readouterr().err


def test_serve_prefix_cache_flags_reach_the_llm_and_a_bad_chunk_is_refused_before_loading(
    llm_kwargs, monkeypatch, capsys
):
    with pytest.raises(_Built):
        main(["serve", "--no-prefix-cache", "--prefill-chunk", "64", "--prefill-budget", "100"])
    assert (llm_kwargs["prefix_cache"], llm_kwargs["prefill_chunk"], llm_kwargs["prefill_budget"]) == (
        False,
        64,
        100,
    )
    with pytest.raises(_Built):
        main(["serve"])
    assert (llm_kwargs["prefix_cache"], llm_kwargs["prefill_chunk"]) == (True, 256)
    monkeypatch.setattr(k26, "LLM", lambda *a, **kw: pytest.fail("loaded before --prefill-chunk was checked"))
    assert main(["serve", "--prefill-chunk", "300"]) == 2
    assert "--prefill-chunk 300" in capsys.readouterr().err


def test_generate_start_up_flags_reach_the_llm(llm_kwargs, tmp_path):
    """`generate --cache-dir D --tp 2 --allreduce nccl` builds the LLM with them; no --allreduce: fused."""
    with pytest.raises(_Built):
        main(["generate", "--prompt", "hi", "--cache-dir", str(tmp_path), "--tp", "2", "--allreduce", "nccl"])
    assert (llm_kwargs["cache_dir"], llm_kwargs["allreduce"], llm_kwargs["tp"]) == (str(tmp_path), "nccl", 2)
    with pytest.raises(_Built):
        main(["generate", "--prompt", "hi"])
    assert llm_kwargs["allreduce"] == "fused"


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "hi"], ["serve"]])
def test_an_allreduce_flag_without_tensor_parallel_ranks_is_refused_before_loading(cmd, llm_kwargs, capsys):
    # (it was taken and ignored at TP 1, where an unused --budget or --drafter is refused)
    assert main([*cmd, "--allreduce", "calibrate"]) == 2
    assert "--allreduce calibrate" in capsys.readouterr().err and not llm_kwargs


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "hi"], ["serve"]])
@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tp", "3"], "--tp 3: tensor-parallel size 3"),
        (["--max-model-len", "99999"], "--max-model-len 99999"),
    ],
)
def test_tp_and_context_flags_are_named_by_generate_and_serve_before_loading(
    cmd, flags, named, llm_kwargs, capsys
):
    assert main([*cmd, *flags]) == 2
    assert named in capsys.readouterr().err and not llm_kwargs


def test_generate_allocates_one_cache_row_for_its_one_prompt(llm_kwargs):
    # LLM's default max_batch of 8 rows cost 8x the KV cache, and the memory plan then refused a long
    # --max-model-len naming max_batch, which generate has no flag for
    with pytest.raises(_Built):
        main(["generate", "--prompt", "hi"])
    assert llm_kwargs["max_batch"] == 1


def test_budget_arguments_take_auto_where_documented_and_refuse_what_would_be_ignored(no_loading, capsys):
    from k26.__main__ import plan_generate
    from k26.cli_parser import MAX_BUDGET, build_parser
    from k26.server.cli import check_args
    from k26.spec.step import MAX_BUDGET as SPEC_MAX

    assert MAX_BUDGET == SPEC_MAX
    a = build_parser().parse_args(["generate", "--budget", "auto", "--prompt", "hi"])
    assert a.budget == "auto" and plan_generate(a).spec.budget == "auto"
    served = build_parser().parse_args(["serve", "--model", TARGET, "--budget", "5"])  # no drafter: AR
    with pytest.raises(ValueError, match=r"--budget applies to --spec ddtree, not ar \(no --drafter"):
        check_args(served)
    check_args(build_parser().parse_args(["serve", "--budget", "5"]))  # the embedded pair: DDTree
    check_args(build_parser().parse_args(["serve", "--model", TARGET, "--budget", "auto"]))  # the default
    unused = build_parser().parse_args(["serve", "--model", TARGET, "--spec", "ar", "--drafter", TARGET])
    with pytest.raises(ValueError, match="--drafter with --spec ar: autoregressive decoding uses no drafter"):
        check_args(unused)  # (serve dropped it without a word; generate refused it)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--budget", str(MAX_BUDGET + 1)])
    assert "expected a DDTree budget in [1, 255]" in capsys.readouterr().err


def test_serve_host_that_does_not_resolve_is_refused_before_loading(llm_kwargs, capsys):
    # (.invalid: a name RFC 2606 reserves never to resolve)
    assert main(["serve", "--host", "no-such-host.invalid"]) == 2
    assert "--host no-such-host.invalid: not an address" in capsys.readouterr().err and not llm_kwargs
    with pytest.raises(_Built):
        main(["serve", "--host", "127.0.0.1"])


@pytest.mark.parametrize(
    "flags, match",
    [  # (found in a bug hunt: both started a server — one answering 413 to every request, one renamed)
        (["--max-request-mb", "0.0000001"], "--max-request-mb 1e-07: below the least cap, 1024 bytes"),
        (["--served-model-name", ""], "--served-model-name is empty"),
        (["--served-model-name", "  "], "--served-model-name is empty"),
    ],
)
def test_serve_sizes_and_names_that_serve_nothing_are_refused_before_loading(
    flags, match, llm_kwargs, capsys
):
    assert main(["serve", *flags]) == 2
    assert match in capsys.readouterr().err and not llm_kwargs
    with pytest.raises(_Built):
        main(["serve", "--max-request-mb", "0.001", "--served-model-name", "m"])


def test_serve_port_taken_is_refused_before_loading(no_loading, capsys):
    """uvicorn found it taken only after the load (its one ERROR line, exit 3, after '[k26] serving ...')."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err = run(capsys, "serve", "--device", "cpu", "--port", str(port))
    assert rc == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)" in err


def test_serve_port_check_skips_an_address_family_the_kernel_lacks(monkeypatch):
    # (IPv6 off while localhost resolves to ::1 too: socket() raised OSError out of the check, a traceback,
    # where uvicorn's asyncio server skips the family and serves on 127.0.0.1)
    import socket

    import k26.__main__ as cli

    real = socket.socket
    v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))
    v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **kw: [v6, v4])

    def no_v6(family=-1, *a, **kw):
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real(family, *a, **kw)

    monkeypatch.setattr(socket, "socket", no_v6)
    with real(socket.AF_INET, socket.SOCK_STREAM) as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cli.listen_arg("localhost", port)  # no exception: the IPv4 address was checked, the IPv6 one skipped


def test_a_graph_capture_failure_is_one_line_not_a_traceback(monkeypatch, capsys):
    # (a DDTree budget or batch whose graphs do not fit the GPU: the capture's RuntimeError, which names
    # the remedies, went up through main() as a traceback)
    from k26.graphs.runner import CaptureError

    def fail(*a, **kw):
        raise CaptureError(
            "CUDA graph capture of bucket (batch 8, nodes 256) failed: out of memory. Reduce ..."
        )

    monkeypatch.setattr(k26, "LLM", fail)
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("k26: error: CUDA graph capture of bucket") and err.count("\n") == 1
    monkeypatch.setattr(k26, "LLM", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # other runtime errors still surface whole
        main(["generate", "--prompt", "hi"])


@pytest.mark.parametrize("spec", [["--budget", "200"], ["--spec", "dflash"]])
def test_serve_refuses_a_fixed_spec_the_context_cannot_fit_before_loading(
    llm_kwargs, monkeypatch, capsys, spec
):
    """(Found in a bug hunt: the engine thread refused it after the whole load, as a traceback from the thread
    and another from main's re-raise, exit 1.) As `generate` does: one line, exit 2, nothing loaded."""
    monkeypatch.setattr(k26, "LLM", lambda *a, **kw: pytest.fail("loaded before the spec was fitted"))
    assert main(["serve", "--device", "cpu", "--max-model-len", "8", *spec]) == 2
    assert "max_model_len=8" in capsys.readouterr().err


def test_bench_prompts_longer_than_the_models_context_are_named(tmp_path):
    """(Found in a bug hunt: a model whose context is shorter than bench's prompts was told its prompts
    "leave room for -12".)"""
    import argparse
    import json

    from k26.__main__ import _tokens_arg
    from k26.embedded import default_model_dir

    cfg = json.loads((default_model_dir() / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 16
    cfg["text_config"]["rope_scaling"]["original_max_position_embeddings"] = 4  # (YaRN factor 4: 16 / 4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match="the 20-token prompts of this command do not fit the model's context of 16"
    ):
        _tokens_arg(argparse.Namespace(model=str(tmp_path), max_tokens=1), 20)


def test_info_startup_refuses_a_broken_drafter_before_printing_anything(tmp_path, capsys):
    """(Found in a bug hunt: `info --startup --drafter DIR` printed the whole config, then said DIR's
    config.json is missing.)"""
    assert main(["info", "--startup", "--device", "cpu", "--drafter", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "config.json" in err


def test_an_unknown_flag_is_said_with_its_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: k26 generate" in err and "unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        main([])
    assert "required: command" in capsys.readouterr().err


def test_a_rank_count_from_torchrun_is_named_as_such(llm_kwargs, monkeypatch, capsys):
    # (it said --tp 3 with no --tp on the command line)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert main(["generate", "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "torchrun's WORLD_SIZE 3: tensor-parallel size 3" in err and "--tp" not in err and not llm_kwargs


def test_port_zero_is_bound_before_loading_and_its_port_announced(monkeypatch, capsys):
    # (found in an audit: serve --port 0 announced "http://127.0.0.1:0/v1"; the port the system picked showed
    # only in uvicorn's own line)
    import k26.server
    from k26.cli_args import listen_arg

    sock = listen_arg("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()
    got = {}

    def run_server(engine, name, host, port, sock=None, **kw):
        got.update(port=port, sock=sock)

    monkeypatch.setattr(k26.server, "run_server", run_server)
    assert main(["serve", "--spec", "ar", "--port", "0", "--max-batch", "1"]) == 0
    said = capsys.readouterr().err
    assert got["sock"] is not None and got["port"] == got["sock"].getsockname()[1] > 0
    assert f"on http://127.0.0.1:{got['port']}/v1" in said
    got["sock"].close()
