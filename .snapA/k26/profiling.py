"""Phase ranges (prefill / draft / tree / verify / accept / replay / capture) for both timelines: NVTX for
nsys (the `nvtx` package, else torch's NVTX bindings, else nothing) and torch.profiler's `record_function`
for `python -m k26 profile` traces (nsys may be absent, and torch.profiler does not show NVTX)."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

try:
    import nvtx as _nvtx
except ImportError:  # the package is a dependency, but a bare GPU image may lack it
    _nvtx = None


@contextlib.contextmanager
def nvtx_range(name: str):
    """One named range on the NVTX and the torch.profiler timelines. `record_function` only while a
    profiler records: it costs ~5 µs a call, against ~50 µs of host time per graph step."""
    with contextlib.ExitStack() as stack:
        if torch.autograd._profiler_enabled():
            stack.enter_context(record_function(name))
        if _nvtx is not None:
            stack.enter_context(_nvtx.annotate(name, domain="k26"))
        elif torch.cuda.is_available():
            torch.cuda.nvtx.range_push(name)
            stack.callback(torch.cuda.nvtx.range_pop)
        yield
