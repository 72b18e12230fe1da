"""Front door of the vocabulary top-k: `torch.ops.k26.logits_topk`, its fake, input checks before any launch
and the CUDA kernels (csrc/logits_topk.cu: a block per 4,096-column chunk of a row, then a block per row); the
pure-torch reference `reference.logits_topk` (the specification) on every other device; for shapes the kernels
do not hold (k above 64, more than 4,096 / k chunks of a row, more than 65,535 rows: said once) `keyed_topk`,
the reference's results by torch.topk over unique keys.

    logits_topk(x [..., V] float, k) -> (values [..., k] fp32, descending; indices [..., k] int64;
                                         lse [...] fp32)

Equal values come in column order (a stable descending sort's), NaN above everything: the indices are exact.
The log-sum-exp is summed in another order than torch.logsumexp's (chunk maxima, then the chunks): equal to
within fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from . import reference
from .log import say_once


@torch.library.custom_op("k26::logits_topk", mutates_args=())
def logits_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(x, k)
    return reference.logits_topk(x, k)


@logits_topk.register_fake
def _(x, k):
    check_inputs(x, k)
    lead = x.shape[:-1]
    return (
        x.new_empty((*lead, k), dtype=torch.float32),
        x.new_empty((*lead, k), dtype=torch.int64),
        x.new_empty(lead, dtype=torch.float32),
    )


def check_inputs(x: torch.Tensor, k: int) -> None:
    """Every shape / dtype problem as a ValueError naming the argument (host metadata only)."""
    if not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"logits_topk: x must be floating [..., V], got {x.dtype} {list(x.shape)}")
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"logits_topk: k={k} must lie in [1, {x.shape[-1]}] (the last dimension of x)")


def keyed_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's results by torch.topk over unique int64 keys — the value's fp32 order (NaN above all,
    -0.0 as +0.0) above the complemented column, so equal values come in column order — instead of a whole
    sort of each row: the shapes the kernels do not hold (k > 64: budgets above 64) at topk's cost."""
    x = x.float()
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the fp32 bits, unsigned
    bits = torch.where(bits == 0x80000000, 0, bits)  # -0.0 as +0.0
    key = torch.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)  # fp32 order, unsigned
    key = torch.where(x.isnan(), 0xFFFFFFFF, key)
    cols = torch.arange(x.shape[-1], device=x.device)
    _, i = ((key << 31) | (0x7FFFFFFF - cols)).topk(k, dim=-1)  # 31 bits of column: V < 2^31
    return x.gather(-1, i), i, torch.logsumexp(x, dim=-1)


@functools.cache  # once per process, like build.library
def _library() -> ctypes.CDLL:
    """The kernel library with this op's ctypes signatures (csrc/logits_topk.cu)."""
    from .build import library  # lazily: `python -m k26.ops.build` must not import itself first

    lib = library()
    for name in ("k26_logits_topk_max_k", "k26_logits_topk_chunk"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    lib.k26_logits_topk_workspace.restype = ctypes.c_size_t
    lib.k26_logits_topk_workspace.argtypes = [ctypes.c_int] * 3
    lib.k26_logits_topk.restype = ctypes.c_int
    # x; R, V, k; values, indices, lse, workspace, stream
    lib.k26_logits_topk.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5
    return lib


@functools.cache
def _limits() -> tuple[int, int]:
    """The kernels' largest k and chunk width (csrc/logits_topk.cu), asked once: the draft calls the op every
    step."""
    lib = _library()
    return lib.k26_logits_topk_max_k(), lib.k26_logits_topk_chunk()


def _unsupported(R: int, V: int, k: int) -> str | None:
    max_k, chunk = _limits()
    chunks = -(-V // chunk)
    if k > max_k:
        return f"k={k} above the kernel's {max_k}"
    if chunks * k > chunk:
        return f"{V} columns at k={k} (more candidates than one merge block holds)"
    if R > 65535:
        return f"{R} rows (the grid's limit is 65,535)"
    return None


@logits_topk.register_kernel("cuda")
def _(x, k):
    from .build import available

    check_inputs(x, k)
    V = x.shape[-1]
    R = x.numel() // V
    if R == 0 or not available():
        return reference.logits_topk(x, k)
    lib = _library()
    why = _unsupported(R, V, k)
    if why is not None:
        say_once(__name__, logging.INFO, f"k26.logits_topk: {why} runs torch.topk on order keys + logsumexp")
        return keyed_topk(x, k)
    x2 = x.reshape(R, V).float().contiguous()
    values = torch.empty(R, k, dtype=torch.float32, device=x.device)
    indices = torch.empty(R, k, dtype=torch.int64, device=x.device)
    lse = torch.empty(R, dtype=torch.float32, device=x.device)
    ws = torch.empty(lib.k26_logits_topk_workspace(R, V, k), dtype=torch.uint8, device=x.device)
    err = lib.k26_logits_topk(
        x2.data_ptr(),
        R,
        V,
        k,
        values.data_ptr(),
        indices.data_ptr(),
        lse.data_ptr(),
        ws.data_ptr(),
        torch.cuda.current_stream(x.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"logits_topk: CUDA launch failed with error {err}")
    lead = x.shape[:-1]
    return values.view(*lead, k), indices.view(*lead, k), lse.view(lead)
