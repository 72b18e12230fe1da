"""`python -m k26 serve`: arguments checked before the model loads, then the engine thread and uvicorn."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from ..cli_args import budget_arg, context_args
from ..cli_parser import AR_WITH_DRAFTER, DTYPES
from ..dist import one_process

MIN_REQUEST_BYTES = 1024  # --max-request-mb's least: a short chat request with its headers' worth of JSON


def _method(a: argparse.Namespace) -> str:
    """The decoding method: --spec, else DDTree with a drafter (the embedded pair has one), else AR."""
    return a.spec or ("ddtree" if a.drafter or not a.model else "ar")


def check_args(a: argparse.Namespace) -> None:
    """Every argument, before minutes of loading a real checkpoint."""
    budget_arg(a.budget)
    if a.spec in ("dflash", "ddtree") and not a.drafter and a.model:
        raise ValueError(f"--spec {a.spec} needs --drafter DIR")
    if a.spec == "ar" and a.drafter:  # (it was dropped without a word)
        raise ValueError(AR_WITH_DRAFTER)
    method = _method(a)
    if a.budget not in (None, "auto") and method != "ddtree":  # ('auto': the default, said aloud)
        why = "" if a.spec else " (no --drafter: autoregressive)"
        raise ValueError(f"--budget applies to --spec ddtree, not {method}{why}")
    if a.tp is not None and a.tp < 1:
        raise ValueError(f"--tp {a.tp}: expected >= 1")
    one_process("serve", ", --tp N starts the ranks itself")
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port {a.port}: expected 0..65535")
    try:  # (uvicorn would say so only after minutes of loading, without naming the host)
        socket.getaddrinfo(a.host, a.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {a.host}: not an address or a name this machine resolves ({e})") from None
    if a.max_batch < 1 or a.max_waiting < 1:
        raise ValueError("--max-batch and --max-waiting must be >= 1")
    if a.api_key is not None and not a.api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the option out to serve without one")
    env_key = os.environ.get("K26_API_KEY")
    if a.api_key is None and env_key and not env_key.strip():  # ('' is unset; '  ' a key gone wrong)
        raise ValueError(
            "K26_API_KEY in the environment is blank: give a key, or unset it to serve without one"
        )
    if not 1 <= a.prefill_chunk <= 256:
        raise ValueError(
            f"--prefill-chunk {a.prefill_chunk}: expected 1..256 (the attention kernel's largest query)"
        )
    if not 0 < a.max_request_mb < 2**20:
        raise ValueError(f"--max-request-mb {a.max_request_mb}: expected a positive size in MiB")
    if a.max_request_mb * 2**20 < MIN_REQUEST_BYTES:  # (it rounded to 0 bytes: a server refusing every POST)
        raise ValueError(
            f"--max-request-mb {a.max_request_mb}: below the least cap, {MIN_REQUEST_BYTES} bytes"
        )
    if a.served_model_name is not None and not a.served_model_name.strip():
        raise ValueError("--served-model-name is empty: give a name, or leave the option out for the default")
    if a.max_model_len is not None and a.max_model_len < 2:
        raise ValueError(f"--max-model-len {a.max_model_len}: expected >= 2")


def serve(a: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """`python -m k26 serve`; `sock`: bound already (cli_args.listen_arg at --port 0), listened on."""
    check_args(a)
    import torch

    from .. import LLM, SpecConfig
    from ..checks import fit_spec
    from ..config import ModelConfig
    from ..drafter_config import DrafterConfig
    from ..embedded import default_drafter_dir, default_model_dir
    from . import Engine, run_server

    model, drafter = a.model, a.drafter
    if not model:  # the embedded pair: the default model comes with its drafter
        model, drafter = default_model_dir(), drafter or default_drafter_dir()
    spec_name = _method(a)
    if spec_name != "ar" and not drafter:
        raise ValueError(f"--spec {spec_name} needs --drafter DIR")
    budget = "auto" if a.budget in (None, "auto") else int(a.budget)
    spec = SpecConfig(spec_name, budget if spec_name == "ddtree" else None)
    max_len = context_args(ModelConfig.from_dir(model), a.tp or 1, a.max_model_len, a.allreduce)
    if spec_name != "ar" and not spec.auto:
        # A fixed budget or a DFlash chain no step fits the context: refused here, as `generate` does, not by
        # the engine thread after the whole load (a traceback from the thread and one from main's re-raise).
        fit_spec(spec, max_len, DrafterConfig.from_dir(drafter).block_size)
    llm = LLM(
        model,
        drafter=drafter if spec_name != "ar" else None,
        device=a.device,
        dtype=getattr(torch, DTYPES[a.dtype]),
        max_model_len=a.max_model_len,
        max_batch=a.max_batch,
        tp=a.tp or 1,
        compile=a.compile,
        cache_dir=a.cache_dir,
        allreduce=a.allreduce or "fused",
        prefix_cache=not a.no_prefix_cache,
        prefill_chunk=a.prefill_chunk,
        prefill_budget=a.prefill_budget,
    )
    name = a.served_model_name or ("k26-embedded" if not a.model else llm.path.name)
    engine = Engine(llm, spec, max_batch=a.max_batch, max_waiting=a.max_waiting, logprobs=not a.no_logprobs)
    port = sock.getsockname()[1] if sock is not None else a.port  # (--port 0: the one the system picked)
    where = f"http://{a.host}:{port}/v1"
    print(
        f"[k26] serving {name!r} ({spec_name}, max_batch {a.max_batch}, max_model_len {llm.max_model_len}) "
        f"on {where}",
        file=sys.stderr,
    )
    # (the environment keeps it off `ps`; surrounding whitespace, say a key file's newline, is no part of it:
    # clients' header values are trimmed, so such a key could never match)
    key = (a.api_key or os.environ.get("K26_API_KEY") or "").strip() or None
    interrupted = False
    try:
        mb = int(a.max_request_mb * 2**20)
        run_server(engine, name, a.host, port, sock=sock, api_key=key, max_body_bytes=mb)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        close_after(llm, engine, interrupted)
    return 0


def close_after(llm, engine, interrupted: bool) -> None:
    """CUDA graphs, then the TP ranks this LLM started. An engine thread still running (Ctrl-C during the
    start-up's graph capture, a step that outlived the shutdown's waits, a second Ctrl-C) is inside torch's
    C++ code: closing under it could fail, and the interpreter's exit would abort (SIGABRT, "terminate called
    without an active exception"). The process then leaves at once, with the status it was ending with (130
    after Ctrl-C); the driver frees the device, and the TP ranks die with their parent."""
    if engine.thread.is_alive():
        why = "interrupted" if interrupted else "stopped"
        print(f"k26: {why} (the engine was still inside a step or a capture)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130 if interrupted else 0)
    llm.close(wait=10)
