"""Front door of the small-M linear kernel's SwiGLU mode (csrc/linear_smallm.cu,
`linear_swiglu_kernel`): `torch.ops.k26.linear_swiglu`, its reference, fake and input checks.

    linear_swiglu(x [..., K], weight [2 I, K]) -> [..., I]
        F.silu(x @ gate^T) * (x @ up^T),  weight = [gate; up]

The weight is an MLP's gate / up stack as `MLP.fuse_` builds it (gate rows first; no re-layout): a block
reads 8 gate rows and the 8 matching up rows as one 16-row tile and applies SiLU·up in its epilogue, so
gate / up and their product are one launch, and the down projection reads I columns instead of a
[.., 2 I] intermediate and an elementwise kernel. The rounding points are the reference's eager bf16 ops
(gate and up rounded, F.silu's bf16 result, the bf16 product). Served as `k26.linear` is (bf16, K a
multiple of 8, 16-byte rows, up to MAX_ROWS rows in launches of 64: tile mode is batch-invariant);
anything else runs the reference, said once in the log.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from . import pdl
from .linear_cuda import MAX_M, _need, _same_place, _unsupported, kernel_operands
from .log import say_once


def linear_swiglu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def check_swiglu(x: torch.Tensor, weight: torch.Tensor) -> None:
    op = "k26.linear_swiglu"
    _need(
        op,
        x.dim() >= 1 and x.is_floating_point(),
        f"x must be a floating tensor [..., K], got {x.dtype} {list(x.shape)}",
    )
    _need(
        op,
        weight.dim() == 2 and weight.shape[0] % 2 == 0,
        f"weight must be the stacked [gate; up] rows [2 I, K], got {list(weight.shape)}",
    )
    _need(op, x.shape[-1] == weight.shape[1], f"x has K={x.shape[-1]} but weight is {list(weight.shape)}")
    _same_place(op, x, weight=weight)


@torch.library.custom_op("k26::linear_swiglu", mutates_args=())
def linear_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    check_swiglu(x, weight)
    return linear_swiglu_reference(x, weight)


@linear_swiglu.register_fake
def _(x, weight):
    check_swiglu(x, weight)  # (host-side: the fake refuses what the op refuses)
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


@functools.cache  # once per process, like build.library
def _lib() -> ctypes.CDLL:
    from .build import library  # lazily: `python -m k26.ops.build` must not import itself first

    lib = library()
    lib.k26_linear_swiglu.restype = ctypes.c_int
    lib.k26_linear_swiglu.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_longlong] * 3 + [ctypes.c_int, ctypes.c_void_p]
    )
    return lib


@torch.library.register_kernel("k26::linear_swiglu", "cuda")
def _(x, weight):
    check_swiglu(x, weight)
    I2, K = weight.shape
    I = I2 // 2
    M = x.numel() // K if K else 0
    why = _unsupported(x, M, K) or (None if M and I else "an empty shape")
    if why is not None:
        say_once(__name__, logging.INFO, f"k26.linear_swiglu: {why} runs the reference")
        return linear_swiglu_reference(x, weight)
    x2, w = kernel_operands(x, weight, M, K)
    y = torch.empty(M, I, dtype=x.dtype, device=x.device)
    on = int(pdl.enabled_as_given((w, weight)))  # a weight the door copied is still being written: no PDL
    stream = torch.cuda.current_stream(x.device).cuda_stream
    for a in range(0, M, MAX_M):  # launches of MAX_M rows: tile mode gives every row the same bits at any M
        rows = min(MAX_M, M - a)
        ptrs = (x2[a].data_ptr(), w.data_ptr(), y[a].data_ptr())
        err = _lib().k26_linear_swiglu(*ptrs, rows, I, K, x2.stride(0), w.stride(0), I, on, stream)
        if err:
            raise RuntimeError(f"k26.linear_swiglu: CUDA launch failed with error {err}")
    return y.view(*x.shape[:-1], I)
