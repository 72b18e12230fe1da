"""NVTX ranges (the `nvtx` package, else torch's NVTX bindings, else nothing) for nsys timelines."""

from __future__ import annotations

import contextlib

try:
    import nvtx as _nvtx
except ImportError:  # the package is a dependency, but a bare GPU image may lack it
    _nvtx = None


@contextlib.contextmanager
def nvtx_range(name: str):
    if _nvtx is not None:
        with _nvtx.annotate(name, domain="k26"):
            yield
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield
