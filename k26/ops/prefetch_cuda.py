"""`torch.ops.k26.l2_prefetch`: move the bytes of weights a later kernel of the step will stream into L2,
in the background, while latency-bound kernels leave HBM idle (csrc/l2_prefetch.cu says why and how).

    l2_prefetch(ticket int32 [1], tensors) -> None        (ticket += 1)

A prefetch changes no value: the reference only counts the call in `ticket`, and so does the kernel (after
its grid-dependency wait). The ticket is what makes the op observable: declared mutated, torch.compile keeps
the call where the model put it (an op with no output and no mutation is dropped as dead code), and a test
can see that a captured graph launched it. Each tensor's whole storage span is prefetched (a strided view:
from its first to its last element), rounded out to 16 bytes. Off CUDA, or without the kernel library, the
reference runs (nothing to prefetch).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import pdl

MAX_RANGES = 16  # csrc/l2_prefetch.cu: kMaxRanges
CHUNK = 64 << 10  # csrc/l2_prefetch.cu: kChunk, bytes per prefetch instruction


@torch.library.custom_op("k26::l2_prefetch", mutates_args=("ticket",))
def l2_prefetch(ticket: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    check(ticket, tensors)
    ticket += 1


@l2_prefetch.register_fake
def _(ticket, tensors):
    return None


def check(ticket: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Shapes, dtypes and devices, on the host (no device sync: safe before a capture)."""
    if ticket.dtype != torch.int32 or ticket.numel() != 1:
        got = f"{ticket.dtype} {list(ticket.shape)}"
        raise ValueError(f"k26.l2_prefetch: ticket must be one int32, got {got}")
    if len(tensors) > MAX_RANGES:
        raise ValueError(f"k26.l2_prefetch: at most {MAX_RANGES} tensors a call, got {len(tensors)}")
    for i, t in enumerate(tensors):
        if t.device != ticket.device:
            raise ValueError(f"k26.l2_prefetch: tensors[{i}] is on {t.device}, ticket on {ticket.device}")


def span(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, byte count) of the memory `t` covers, rounded out to 16 bytes; (address, 0) if empty."""
    if t.numel() == 0:
        return t.data_ptr() & ~15, 0
    if any(s < 0 for s in t.stride()):
        raise ValueError("k26.l2_prefetch: tensors with negative strides are not served")
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    begin, end = t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    begin &= ~15
    return begin, (end - begin + 15) & ~15


@functools.cache
def _lib() -> ctypes.CDLL:
    from .build import library

    lib = library()
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.k26_l2_prefetch.restype = I
    lib.k26_l2_prefetch.argtypes = [P, P, I, P, I, I, P]
    return lib


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@torch.library.register_kernel("k26::l2_prefetch", "cuda")
def _(ticket, tensors):
    from .build import available

    check(ticket, tensors)
    if not available():
        ticket += 1
        return
    spans = [span(t) for t in tensors]
    n = len(spans)
    begin, nbytes = (ctypes.c_uint64 * max(n, 1))(), (ctypes.c_uint64 * max(n, 1))()
    for k, (b, c) in enumerate(spans):
        begin[k], nbytes[k] = b, c
    chunks = sum(-(-c // CHUNK) for _, c in spans)
    index = torch.cuda.current_device() if ticket.device.index is None else ticket.device.index
    blocks = max(1, min(_sms(index), chunks))
    stream = torch.cuda.current_stream(ticket.device).cuda_stream
    e = _lib().k26_l2_prefetch(begin, nbytes, n, ticket.data_ptr(), blocks, int(pdl.ENABLED), stream)
    if e != 0:
        from .allreduce_cuda import cuda_error

        raise RuntimeError(f"k26.l2_prefetch: launch failed: {cuda_error(e)}")
