"""`torch.ops.k26.mla_glue`: MLA's glue between the q_a / kv_a projection and the q_b projection in one
kernel (csrc/mla_glue.cu): the q_a and kv_a RMSNorms, the YaRN RoPE of k_pe (interleaved pairs) and the
latent-cache write. Its reference is the composition the model ran before (the specification):

    q      = rms_norm(q_a, q_norm_weight, eps)                                     -> returned
    latent = [rms_norm(kv_a[..., :R], kv_norm_weight, eps), rope(kv_a[..., R:], positions, inv_freq)]
    cache[rows[b], prefix_lens[b] + n] = latent[b, n]                               (mla_write_cache)

The kernel serves bf16 activations, weights and cache with 16-byte aligned rows, Q and R multiples of 8,
Q + R <= 4096 and P even; anything else (float32 test models, odd widths) runs the reference on the same
device, said once in the log.

`torch.ops.k26.mla_glue_linear` is the glue and the q_b projection after it in one launch
(csrc/mla_glue_linear.cu), `linear(mla_glue(...), weight)` bit for bit at K2.6's widths (the kernel's header
says when), up to GLUE_LINEAR_MAX_TOKENS tokens (one: batch-1 decode, where it measured faster); more tokens,
or a shape either kernel does not serve, run the two ops (each with its kernel or its reference).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from . import pdl, reference
from .log import say_once
from .reference import rms_norm, rope


def mla_glue_reference(
    q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps: float, cache, rows, prefix_lens
) -> torch.Tensor:
    R = kv_norm_weight.shape[0]
    c_kv = rms_norm(kv_a[..., :R], kv_norm_weight, eps)
    k_pe = rope(kv_a[..., R:], positions, inv_freq)
    reference.mla_write_cache(cache, torch.cat([c_kv, k_pe], dim=-1), rows, prefix_lens)
    return rms_norm(q_a, q_norm_weight, eps)


@torch.library.custom_op("k26::mla_glue", mutates_args=("cache",))
def mla_glue(
    q_a: torch.Tensor,
    kv_a: torch.Tensor,
    q_norm_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> torch.Tensor:
    check(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, cache, rows, prefix_lens)
    reference.check_cache_span("k26.mla_glue", cache, rows, prefix_lens, q_a.shape[1])
    return mla_glue_reference(
        q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens
    )


@mla_glue.register_fake
def _(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens):
    check(
        q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, cache, rows, prefix_lens
    )  # (host-side)
    return torch.empty_like(q_a, memory_format=torch.contiguous_format)


def mla_glue_linear_reference(*glue_args, weight: torch.Tensor) -> torch.Tensor:
    """linear(mla_glue(...), weight): `glue_args` are mla_glue's, in its order."""
    return F.linear(mla_glue_reference(*glue_args), weight)


@torch.library.custom_op("k26::mla_glue_linear", mutates_args=("cache",))
def mla_glue_linear(
    q_a: torch.Tensor,
    kv_a: torch.Tensor,
    q_norm_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    check(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, cache, rows, prefix_lens, weight)
    reference.check_cache_span("k26.mla_glue_linear", cache, rows, prefix_lens, q_a.shape[1])
    glue_args = (q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens)
    return mla_glue_linear_reference(*glue_args, weight=weight)


@mla_glue_linear.register_fake
def _(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens, weight):
    check(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, cache, rows, prefix_lens, weight)
    return q_a.new_empty(*q_a.shape[:2], weight.shape[0])


# ---------------------------------------------------------------- checks


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"k26.mla_glue: {msg}")


def check(
    q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, cache, rows, prefix_lens, weight=None
) -> None:
    """Shapes, dtypes and devices, on the host (no device sync: safe to run before a capture); `weight`: the
    q_b projection's [n, Q] of mla_glue_linear."""
    _need(q_a.dim() == 3 and q_a.is_floating_point(), f"q_a must be a float [B, N, Q], got {list(q_a.shape)}")
    B, N, Q = q_a.shape
    _need(
        kv_a.dim() == 3 and tuple(kv_a.shape[:2]) == (B, N),
        f"kv_a must be [B={B}, N={N}, R + P], got {list(kv_a.shape)}",
    )
    _need(tuple(q_norm_weight.shape) == (Q,), f"q_norm_weight must be [{Q}], got {list(q_norm_weight.shape)}")
    _need(kv_norm_weight.dim() == 1, f"kv_norm_weight must be [R], got {list(kv_norm_weight.shape)}")
    R = kv_norm_weight.shape[0]
    P = kv_a.shape[2] - R
    _need(P > 0 and P % 2 == 0, f"kv_a's last dim {kv_a.shape[2]} must be R={R} plus an even rope width")
    _need(tuple(inv_freq.shape) == (P // 2,), f"inv_freq must be [{P // 2}], got {list(inv_freq.shape)}")
    _need(inv_freq.dtype == torch.float32, f"inv_freq must be float32, got {inv_freq.dtype}")
    _need(tuple(positions.shape) == (B, N), f"positions must be [{B}, {N}], got {list(positions.shape)}")
    _need(
        cache.dim() == 3 and cache.shape[2] == R + P,
        f"cache must be [rows, len, {R + P}], got {list(cache.shape)}",
    )
    for name, t in (("rows", rows), ("prefix_lens", prefix_lens)):
        _need(tuple(t.shape) == (B,), f"{name} must be [{B}], got {list(t.shape)}")
    for name, t in (("positions", positions), ("rows", rows), ("prefix_lens", prefix_lens)):
        _need(t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}")
    if weight is not None:
        _need(
            weight.dim() == 2 and weight.shape[1] == Q, f"weight must be [n, Q={Q}], got {list(weight.shape)}"
        )
    named = (("kv_a", kv_a), ("q_norm_weight", q_norm_weight), ("kv_norm_weight", kv_norm_weight))
    for name, t in named + ((("weight", weight),) if weight is not None else ()):
        _need(t.dtype == q_a.dtype, f"{name} dtype {t.dtype} differs from q_a's {q_a.dtype}")
    for name, t in (
        ("kv_a", kv_a),
        ("q_norm_weight", q_norm_weight),
        ("kv_norm_weight", kv_norm_weight),
        ("positions", positions),
        ("inv_freq", inv_freq),
        ("cache", cache),
        ("rows", rows),
        ("prefix_lens", prefix_lens),
        ("weight", q_a if weight is None else weight),
    ):
        _need(t.device == q_a.device, f"{name} is on {t.device}, q_a on {q_a.device}")


# ---------------------------------------------------------------- launch


@functools.cache  # once per process, like build.library
def _lib() -> ctypes.CDLL:
    from .build import library  # lazily: `python -m k26.ops.build` must not import itself first

    lib = library()
    lib.k26_mla_glue.restype = ctypes.c_int
    lib.k26_mla_glue.argtypes = (
        [ctypes.c_void_p] * 10
        + [ctypes.c_longlong] * 4
        + [ctypes.c_int] * 5
        + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    )
    lib.k26_mla_glue_max_width.restype = ctypes.c_int
    lib.k26_mla_glue_linear.restype = ctypes.c_int
    lib.k26_mla_glue_linear.argtypes = (
        [ctypes.c_void_p] * 11
        + [ctypes.c_longlong] * 5
        + [ctypes.c_int] * 6
        + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    )
    lib.k26_mla_glue_linear_max_tokens.restype = ctypes.c_int
    lib.k26_mla_glue_linear_row_bytes.restype = ctypes.c_int
    lib.k26_mla_glue_linear_row_bytes.argtypes = [ctypes.c_int]
    lib.k26_mla_glue_linear_max_smem.restype = ctypes.c_int
    return lib


def _rows(t: torch.Tensor) -> int | None:
    """Element stride between consecutive tokens of a [B, N, X] tensor with a unit last stride, if uniform
    and 16-byte aligned (B and N flatten to one token index); else None."""
    B, N, _ = t.shape
    if t.stride(2) != 1 or (B > 1 and N > 0 and t.stride(0) != N * t.stride(1)):
        return None
    ld = t.stride(1)
    return ld if ld % 8 == 0 and t.data_ptr() % 16 == 0 else None


def _unsupported(q_a, cache, q_norm_weight, kv_norm_weight, R: int, P: int) -> str | None:
    from .build import available

    Q = q_a.shape[2]
    if q_a.dtype != torch.bfloat16 or cache.dtype != torch.bfloat16:
        return f"dtype {q_a.dtype} / cache {cache.dtype} (the kernel is bf16)"
    if Q % 8 or R % 8:
        return f"Q={Q} or R={R} not a multiple of 8"
    if P // 2 > 256 or Q + R > 4096:
        return f"widths Q={Q}, R={R}, P={P} beyond the kernel's block"
    if cache.stride(2) != 1 or cache.stride(0) % 8 or cache.stride(1) % 8 or cache.data_ptr() % 16:
        return "a cache with unaligned rows"
    if any(t.data_ptr() % 16 for t in (q_norm_weight, kv_norm_weight)):
        return "norm weights not 16-byte aligned"
    if not available():
        return "no kernel library"
    return None


def _kernel_inputs(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, rows, prefix_lens):
    """The glue kernel's first eight pointer arguments as tensors (q_a, kv_a, both norm weights, positions,
    inv_freq, rows, prefix_lens; 16-byte rows, a copy where not: a copy, not a fallback), q_a's and kv_a's row
    strides, and whether PDL may be used: the norm weights are read before the kernel's wait, so a copy made
    here (the kernel just before) rules it out."""
    q_ld, kv_ld = _rows(q_a), _rows(kv_a)
    if q_ld is None:
        q_a, q_ld = q_a.contiguous(), q_a.shape[-1]
    if kv_ld is None:
        kv_a, kv_ld = kv_a.contiguous(), kv_a.shape[-1]
    qw, kvw = q_norm_weight.contiguous(), kv_norm_weight.contiguous()  # 1-D: a view stays aligned
    rest = (positions, inv_freq, rows, prefix_lens)
    ins = [q_a, kv_a, qw, kvw, *(t.contiguous() for t in rest)]
    return ins, q_ld, kv_ld, pdl.enabled_as_given((qw, q_norm_weight), (kvw, kv_norm_weight))


@torch.library.register_kernel("k26::mla_glue", "cuda")
def cuda_mla_glue(
    q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens
):
    check(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, cache, rows, prefix_lens)
    B, N, Q = q_a.shape
    R = kv_norm_weight.shape[0]
    P = kv_a.shape[2] - R
    # Before either path: the kernel writes unchecked, and the reference would wrap a negative row or
    # prefix onto another sequence's slots.
    reference.check_cache_span("k26.mla_glue", cache, rows, prefix_lens, N)
    why = _unsupported(q_a, cache, q_norm_weight, kv_norm_weight, R, P) or (
        None if B * N else "an empty batch"
    )
    if why is not None:
        say_once(__name__, logging.INFO, f"k26.mla_glue: {why} runs the reference")
        return mla_glue_reference(
            q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens
        )
    ins, q_ld, kv_ld, early_ok = _kernel_inputs(
        q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, rows, prefix_lens
    )
    out = torch.empty(B, N, Q, dtype=q_a.dtype, device=q_a.device)
    err = _lib().k26_mla_glue(
        *(t.data_ptr() for t in (*ins, out, cache)),
        q_ld,
        kv_ld,
        cache.stride(0),
        cache.stride(1),
        B * N,
        N,
        Q,
        R,
        P,
        float(eps),
        int(early_ok),
        torch.cuda.current_stream(q_a.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"k26.mla_glue: CUDA launch failed with error {err}")
    return out


# Tokens up to which the fused launch runs (the kernel serves 16; the bits are the same either way): each tile
# block normalises all of them on its own path after its wait. Measured in the compiled K2.6 step (H200,
# 2026-12-05-glue-linear-session21-h200.md, A/B in one call): 1 token 4.24-4.26 -> 4.21 ms, 8 tokens
# 5.14 -> 5.19-5.21, 16 tokens 6.78 -> 7.36 (6.75 -> 7.06 with the rows' loads one at a time).
GLUE_LINEAR_MAX_TOKENS = 1


@torch.library.register_kernel("k26::mla_glue_linear", "cuda")
def glue_linear_cuda(
    q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens, weight
):
    check(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, cache, rows, prefix_lens, weight)
    B, N, Q = q_a.shape
    R = kv_norm_weight.shape[0]
    P = kv_a.shape[2] - R
    glue_args = (q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens)
    why = _unsupported(q_a, cache, q_norm_weight, kv_norm_weight, R, P)
    if why is None:  # the glue's library loaded: the fused kernel's own limits
        lib = _lib()
        served = lib.k26_mla_glue_linear_max_tokens()
        if served * lib.k26_mla_glue_linear_row_bytes(Q) > lib.k26_mla_glue_linear_max_smem():
            why = f"Q={Q} beyond its shared memory"
        elif weight.stride(1) != 1 or weight.stride(0) % 8 or weight.data_ptr() % 16:
            why = "a weight with unaligned rows"
    if why is not None:
        say_once(__name__, logging.INFO, f"k26.mla_glue_linear: {why} runs mla_glue, then linear")
    # More tokens than it measured faster at: the two ops by design (each with its kernel), nothing to say.
    if why is not None or not 0 < B * N <= min(GLUE_LINEAR_MAX_TOKENS, served):
        return torch.ops.k26.linear(torch.ops.k26.mla_glue(*glue_args), weight)
    reference.check_cache_span("k26.mla_glue_linear", cache, rows, prefix_lens, N)
    ins, q_ld, kv_ld, early_ok = _kernel_inputs(
        q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, rows, prefix_lens
    )
    n = weight.shape[0]
    out = torch.empty(B, N, n, dtype=q_a.dtype, device=q_a.device)
    err = lib.k26_mla_glue_linear(
        *(t.data_ptr() for t in (*ins, cache, weight, out)),
        q_ld,
        kv_ld,
        cache.stride(0),
        cache.stride(1),
        weight.stride(0),
        B * N,
        N,
        Q,
        R,
        P,
        n,
        float(eps),
        int(early_ok),  # W_qb is the caller's own (checked above): read before the wait as given
        torch.cuda.current_stream(q_a.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"k26.mla_glue_linear: CUDA launch failed with error {err}")
    return out
