"""The CLI's directory, file, address and cache-dir arguments, each checked before any weights load
(`python -m k26`, k26/__main__.py): a bad one is one line naming the flag, not an error after minutes of
loading."""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .cache_dir import cache_dir_problem
from .cli_parser import MAX_BUDGET
from .embedded import default_drafter_dir, default_model_dir

if TYPE_CHECKING:
    from .config import ModelConfig


def dir_arg(value: str | None, flag: str) -> Path | None:
    """A checkpoint directory argument: a file (say .../config.json) or a missing path, named with the fix."""
    if value is None:
        return None
    if not value:  # (an unset shell variable, --model "$MODEL": not the current directory)
        raise ValueError(f"{flag} is empty: pass a checkpoint directory")
    p = Path(value)
    if p.is_file():
        raise ValueError(
            f"{flag} {value}: is a file; pass the checkpoint directory that holds it: {p.parent}"
        )
    if not p.is_dir():
        raise ValueError(f"{flag} {value}: no such directory")
    return p


def pair_args(a: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """--model and --drafter checked (None: not given)."""
    return dir_arg(a.model, "--model"), dir_arg(a.drafter, "--drafter")


def out_arg(value: str | None, flag: str) -> None:
    """An output file: writable now, not found unwritable after minutes of loading and running."""
    if value is None:
        return
    path = Path(value).resolve()
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {value}: directory {path.parent} does not exist")
    if path.is_dir():
        raise ValueError(f"{flag} {value}: is a directory")
    try:  # (a probe file: os.access says yes to root even where nothing can be created, /proc say)
        with tempfile.NamedTemporaryFile(dir=path.parent):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {value}: cannot write in {path.parent} ({e.strerror})") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {value}: not writable")


def listen_arg(host: str, port: int) -> socket.socket | None:
    """serve's --host / --port free to listen on now, not found taken (uvicorn's one ERROR line) after minutes
    of loading; bound as uvicorn's asyncio server binds: every address of the host, SO_REUSEADDR, IPv6 ones
    v6-only. Port 0: the socket is bound here, on the host's first address, and returned (the server listens
    on it), so the port the system picked can be announced (it said ":0")."""
    if port == 0:
        family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        return sock
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # (a family this kernel lacks, e.g. IPv6 off: asyncio skips it too)
            continue
        with sock as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror})") from None
    return None


def budget_arg(budget: int | str | None) -> None:
    """--budget (generate and serve): 'auto' or a DDTree budget in [1, MAX_BUDGET], named by its flag."""
    if budget not in (None, "auto") and not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"--budget {budget}: expected 'auto' or an integer in [1, {MAX_BUDGET}]")


def cache_dir_arg(value: str | None) -> None:
    """--cache-dir: created on first use, so it may be missing, but not a file (nor empty: the current
    directory)."""
    if value == "":
        raise ValueError("--cache-dir is empty: pass a directory (created on first use)")
    if value is None:
        return
    why = cache_dir_problem(value)
    if why is not None:
        raise ValueError(f"--cache-dir {value}: {why}")


def resolved_pair(a: argparse.Namespace) -> tuple[Path, Path | None]:
    """--model and --drafter checked; without --model, the embedded pair (its drafter unless one is given),
    as `LLM` takes it."""
    model, drafter = pair_args(a)
    if model is None:
        model, drafter = default_model_dir(), drafter or default_drafter_dir()
    return model, drafter


def context_args(
    cfg: ModelConfig, tp: int, max_model_len: int | None, allreduce: str | None, tp_from: str = "--tp"
) -> int:
    """generate's and serve's --tp, --max-model-len and --allreduce against the model's config (read, no
    weights): the context length, each bad value named by its flag (`tp_from`: where the rank count came
    from, torchrun's WORLD_SIZE when no --tp was given)."""
    from .checks import default_max_model_len
    from .config import ConfigError

    try:
        cfg.check_tp(tp)
    except ConfigError as e:
        raise ValueError(f"{tp_from} {tp}: {e}") from None
    if allreduce is not None and tp == 1:  # (as an unused --budget or --drafter: said, not ignored)
        raise ValueError(f"--allreduce {allreduce}: applies to tensor-parallel runs (--tp > 1)")
    max_len = max_model_len or default_max_model_len(cfg)
    if not 1 < max_len <= cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_len}: must lie in (1, {cfg.max_position_embeddings}] "
            "(the model's max_position_embeddings)"
        )
    return max_len
