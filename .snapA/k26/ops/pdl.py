"""Programmatic dependent launch for every k26 kernel launch (csrc/pdl.cuh), one switch, on by default:
a kernel launched with the attribute may start while the one before it finishes (its weight prefetch and
prologue overlap that kernel's tail). Read when a kernel is launched, so a CUDA graph keeps the setting it
was captured with. Benchmarks and tests turn it off to measure what it buys or to check that it changes no
bit (`with pdl.disabled(): ...`; `profiling/bench_k26.py --no-pdl`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

ENABLED = True


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Launch without the attribute inside the block (captures included)."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


def enabled_as_given(*pairs: tuple) -> bool:
    """Whether to launch with PDL a kernel that reads some inputs before its grid-dependency wait: only when
    each such input (kernel's tensor, caller's tensor) is the caller's own. A copy its front door made (a
    dtype conversion, `.contiguous()`, an alignment clone) would be the kernel just before it, still
    writing while it reads."""
    return ENABLED and all(used.data_ptr() == given.data_ptr() for used, given in pairs)
