"""The load cache's directory argument, checked alike for `LLM(cache_dir=)` and the CLI's --cache-dir before
any weight is read (torch-free: the CLI checks its flags before importing torch)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir_problem(cache_dir: str | os.PathLike) -> str | None:
    """Why `cache_dir` cannot hold the load cache, or None: it may be missing (created on first use) but not
    a file, and the directory it is or will be created in must take a file — found before the load, not as
    a warning after it."""
    p = Path(cache_dir)
    if p.exists() and not p.is_dir():
        return "exists and is not a directory"
    base = p.resolve()
    while not base.exists():  # the directory it will be created in
        base = base.parent
    if not base.is_dir():
        return f"cannot be created, {base} is not a directory"
    try:  # (a probe file: os.access says yes to root where nothing can be created)
        with tempfile.NamedTemporaryFile(dir=base):
            pass
    except OSError as e:
        return f"cannot write in {base} ({e.strerror})"
    return None


def check_cache_dir(cache_dir) -> None:
    """`LLM(cache_dir=)`: a ValueError naming it where `cache_dir_problem` finds one (None: no cache)."""
    if cache_dir is not None and (why := cache_dir_problem(cache_dir)) is not None:
        raise ValueError(f"cache_dir={str(cache_dir)!r}: {why}")  # (it warned after the whole load)
