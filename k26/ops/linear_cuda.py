"""Front door of the small-M linear kernel (csrc/linear_smallm.cu): `torch.ops.k26.linear` and
`torch.ops.k26.linear_grouped`, their references and fakes, input checks before any launch, the split-K plan
and the kernel-owned split-K counters.

    linear(x [..., K], weight [N, K], residual [..., N] | None) -> [..., N]   F.linear(x, weight) (+ residual)
    linear_grouped(x [..., G, K], weight [G, N, K]) -> [..., G, N]            one matrix per group (W_UV)

The kernel serves bf16 with at most 16,384 rows of x (in launches of 64), K a multiple of 8 and 16-byte
aligned rows; anything else (float32 test models, odd strides) runs the reference on the same device, said
once in the log.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math

import torch
import torch.nn.functional as F

from . import pdl
from .log import say_once
from .packed import packed

MAX_M = 64  # rows per launch (the kernel's token tiles)
# Rows served in launches of MAX_M (tile mode is batch-invariant, so chunks change no bit): every decode /
# verify batch the engine forms, 64 sequences x 256 tree tokens (spec.step.MAX_BUDGET + 1).
MAX_ROWS = 16384
UNIT = 32  # k per unit of the kernel's loop
COUNTERS = 1 << 16  # split-K arrival counters per device: more (group, row block) pairs are refused
# Staged x per block: 48 KB needs no opt-in, but the kernel's own static shared memory counts against it
# (at exactly 48 KB of x the launch fails: M = 16 with K = 43008, M = 64 with K = 7168).
X_SMEM_BUDGET = 47 * 1024


# ---------------------------------------------------------------- references and op registration


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    y = F.linear(x, weight)
    return y if residual is None else y + residual


def linear_grouped_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...gk,gnk->...gn", x, weight).contiguous()


@torch.library.custom_op("k26::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    check_linear(x, weight, residual)
    return linear_reference(x, weight, residual)


@linear.register_fake
def _(x, weight, residual=None):
    check_linear(x, weight, residual)  # (host-side: the fake refuses what the op refuses)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("k26::linear_grouped", mutates_args=())
def linear_grouped(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    check_grouped(x, weight)
    return linear_grouped_reference(x, weight)


@linear_grouped.register_fake
def _(x, weight):
    check_grouped(x, weight)
    return x.new_empty(*x.shape[:-1], weight.shape[1])


# ---------------------------------------------------------------- checks


def _need(op: str, cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"{op}: {msg}")


def _same_place(op: str, x: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is None:
            continue
        _need(op, t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
        _need(op, t.dtype == x.dtype, f"{name} dtype {t.dtype} differs from x's {x.dtype}")


def check_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    op = "k26.linear"
    _need(
        op,
        x.dim() >= 1 and x.is_floating_point(),
        f"x must be a floating tensor [..., K], got {x.dtype} {list(x.shape)}",
    )
    _need(op, weight.dim() == 2, f"weight must be [N, K], got {list(weight.shape)}")
    N, K = weight.shape
    _need(op, x.shape[-1] == K, f"x has K={x.shape[-1]} but weight is [N={N}, K={K}]")
    if residual is not None:
        want = [*x.shape[:-1], N]
        _need(op, list(residual.shape) == want, f"residual must be {want}, got {list(residual.shape)}")
    _same_place(op, x, weight=weight, residual=residual)


def check_grouped(x: torch.Tensor, weight: torch.Tensor) -> None:
    op = "k26.linear_grouped"
    _need(
        op,
        x.dim() >= 2 and x.is_floating_point(),
        f"x must be a floating tensor [..., G, K], got {x.dtype} {list(x.shape)}",
    )
    _need(op, weight.dim() == 3, f"weight must be [G, N, K], got {list(weight.shape)}")
    G, N, K = weight.shape
    _need(
        op,
        tuple(x.shape[-2:]) == (G, K),
        f"x ends in {list(x.shape[-2:])} but weight is [G={G}, N={N}, K={K}]",
    )
    _same_place(op, x, weight=weight)


# ---------------------------------------------------------------- launch


@functools.cache  # once per process, like build.library
def _lib() -> ctypes.CDLL:
    from .build import library  # lazily: `python -m k26.ops.build` must not import itself first

    lib = library()
    lib.k26_linear_smallm.restype = ctypes.c_int
    lib.k26_linear_smallm.argtypes = (
        [ctypes.c_void_p] * 6
        + [ctypes.c_int] * 4
        + [ctypes.c_longlong] * 6
        + [ctypes.c_int] * 3
        + [ctypes.c_void_p]
    )
    lib.k26_linear_smallm_max_smem.restype = ctypes.c_int
    lib.k26_linear_smallm_rows_per_block.restype = ctypes.c_int
    return lib


def padded_m(M: int) -> int:
    """Token rows the kernel stages: 8, 16, 32 or 64 (its template instances)."""
    return 8 * (1 << max(0, math.ceil(math.log2(max(1, (M + 7) // 8)))))


def plan_splits(M: int, N: int, K: int, G: int, splits: int | None = None) -> tuple[int, int]:
    """(S, units per split). By default S = 0, tile mode: a block per 16 rows of W, its 8 warps splitting K
    in shared memory (no workspace, no second pass) and batch-invariant (the same bits for a row at every M:
    a verify step reproduces decode). `splits` >= 1 asks for split-K instead (benchmarks, tests): that many
    k-splits, at least as many as staged x needs to fit X_SMEM_BUDGET, at most one per unit."""
    units = math.ceil(K / UNIT)
    if not splits:
        return 0, units
    row_blocks = math.ceil(N / 64) * G
    max_units = (X_SMEM_BUDGET // (2 * padded_m(M)) - UNIT) // UNIT  # the 64-byte row pad included
    splits = max(math.ceil(units / max_units), min(splits, units))
    if row_blocks > COUNTERS and splits > 1:
        raise ValueError(f"k26.linear: {row_blocks} row blocks exceed the {COUNTERS} split-K counters")
    per = math.ceil(units / splits)
    return math.ceil(units / per), per


_counters: dict[int, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The kernel's split-K arrival counters for `device`: zeroed once, reset by the kernel after each use
    (like cuBLAS's workspace, one per device; launches on one stream at a time)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _counters:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "k26.linear: run the model once outside CUDA graph capture first (allocates counters)"
            )
        _counters[idx] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[idx]


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides)


def kernel_operands(x: torch.Tensor, weight: torch.Tensor, M: int, K: int) -> tuple[torch.Tensor, ...]:
    """x as [M, K] rows and a [*, K] weight as the kernel reads them (16-byte aligned rows, unit column
    stride): each the caller's own tensor where it already is, else a packed copy (not a fallback)."""
    x2 = x.reshape(M, K)
    if x2.stride(1) != 1 or not _aligned(x2, x2.stride(0)):
        x2 = packed(x2)
    w = weight if weight.stride(1) == 1 and _aligned(weight, weight.stride(0)) else packed(weight)
    return x2, w


def launch(
    x2, w, residual, y, *, groups: int, strides, splits: int | None = None, pdl_on: bool = True
) -> None:
    """Run the kernel: x2 [M, ...], w rows of K, y [M, ...]; strides (x_ld, x_gs, w_ld, w_gs, y_ld, y_gs).
    More than MAX_M rows (tile mode only): one launch per MAX_M rows, the same bits as one launch. `pdl_on`
    False: without PDL (the kernel loads weights before its wait: off when w is a copy the door just made)."""
    if x2.shape[0] > MAX_M:
        if splits:
            raise ValueError(f"k26.linear: split-K serves at most {MAX_M} rows, got {x2.shape[0]}")
        for a in range(0, x2.shape[0], MAX_M):
            r = residual[a : a + MAX_M] if residual is not None else None
            launch(x2[a : a + MAX_M], w, r, y[a : a + MAX_M], groups=groups, strides=strides, pdl_on=pdl_on)
        return
    M, K = x2.shape[0], w.shape[-1]
    N = w.shape[-2]
    S, per = plan_splits(M, N, K, groups, splits)
    split = S > 1  # only split-K's last-block sums use a workspace and the counters
    partial = torch.empty(groups * S * M * N, dtype=torch.float32, device=x2.device) if split else None
    counters = split_counters(x2.device) if split else None
    err = _lib().k26_linear_smallm(
        x2.data_ptr(),
        w.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        y.data_ptr(),
        partial.data_ptr() if split else None,
        counters.data_ptr() if split else None,
        M,
        N,
        K,
        groups,
        *strides,
        S,
        per,
        int(pdl.ENABLED and pdl_on),
        torch.cuda.current_stream(x2.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"k26.linear: CUDA launch failed with error {err}")


def _unsupported(x: torch.Tensor, M: int, K: int) -> str | None:
    from .build import available

    if x.dtype != torch.bfloat16:
        return f"dtype {x.dtype} (the kernel is bf16)"
    if M > MAX_ROWS:
        return f"more than {MAX_ROWS} rows"
    if K % 8:
        return f"K={K} not a multiple of 8"
    if not available():
        return "no kernel library"
    return None


@torch.library.register_kernel("k26::linear", "cuda")
def _(x, weight, residual=None):
    check_linear(x, weight, residual)
    N, K = weight.shape
    M = x.numel() // K if K else 0
    why = _unsupported(x, M, K) or (None if M and N else "an empty shape")
    if why is not None:
        say_once(__name__, logging.INFO, f"k26.linear: {why} runs the reference (F.linear)")
        return linear_reference(x, weight, residual)
    x2, w = kernel_operands(x, weight, M, K)
    r2 = packed(residual.reshape(M, N)) if residual is not None else None
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    strides = (x2.stride(0), 0, w.stride(0), 0, N, 0)
    launch(x2, w, r2, y, groups=1, strides=strides, pdl_on=pdl.enabled_as_given((w, weight)))
    return y.view(*x.shape[:-1], N)


@torch.library.register_kernel("k26::linear_grouped", "cuda")
def _(x, weight):
    check_grouped(x, weight)
    G, N, K = weight.shape
    M = x.numel() // (G * K) if G * K else 0
    why = _unsupported(x, M, K) or (None if M and N else "an empty shape")
    if why is not None:
        say_once(__name__, logging.INFO, f"k26.linear_grouped: {why} runs the reference (einsum)")
        return linear_grouped_reference(x, weight)
    x3 = x.reshape(M, G, K)
    if x3.stride(2) != 1 or not _aligned(x3, x3.stride(0), x3.stride(1)):
        x3 = packed(x3)
    w = (
        weight
        if weight.stride(2) == 1 and _aligned(weight, weight.stride(0), weight.stride(1))
        else packed(weight)
    )
    y = torch.empty(M, G, N, dtype=x.dtype, device=x.device)
    strides = (x3.stride(0), x3.stride(1), w.stride(1), w.stride(0), G * N, N)
    launch(x3, w, None, y, groups=G, strides=strides, pdl_on=pdl.enabled_as_given((w, weight)))
    return y.view(*x.shape[:-1], N)
