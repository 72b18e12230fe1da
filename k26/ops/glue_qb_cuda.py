"""`torch.ops.k26.mla_glue_qb`: MLA's glue and the q_b projection in one launch (csrc/mla_glue_qb.cu). Its
specification is the composition the model runs without it:

    q_b = linear(mla_glue(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows,
                          prefix_lens), q_b_weight)                      (mla_glue writes the latent cache)

and the kernel gives the same bits as `torch.ops.k26.mla_glue` followed by `torch.ops.k26.linear`
(tests/test_glue_qb_gpu.py). Served: what both of those kernels serve, up to 16 tokens, a row-contiguous
16-byte-aligned q_b weight, a grid of one wave (the projection's 16-row blocks plus one per token, at most
one per SM: its deep tile variant); anything else runs that composition (each op with its own kernel or
reference), said once in the log.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from .glue_cuda import _rows, _unsupported, check, kernel_inputs, mla_glue_reference
from .linear_cuda import linear_reference
from .log import say_once

MAX_TOKENS = 16  # csrc/mla_glue_qb.cu: two token tiles


@torch.library.custom_op("k26::mla_glue_qb", mutates_args=("cache",))
def mla_glue_qb(
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
    q_b_weight: torch.Tensor,
) -> torch.Tensor:
    glue = (q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens)
    check_qb(glue, q_b_weight)
    return linear_reference(mla_glue_reference(*glue), q_b_weight)


@mla_glue_qb.register_fake
def _(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens, q_b):
    return q_a.new_empty(*q_a.shape[:-1], q_b.shape[0])


def check_qb(glue: tuple, q_b_weight: torch.Tensor) -> None:
    """mla_glue's checks of its arguments `glue` (as mla_glue takes them) plus the q_b weight's (host only:
    safe before a capture)."""
    check(*glue[:6], *glue[7:])  # all but eps
    q_a = glue[0]
    Q = q_a.shape[-1]
    if q_b_weight.dim() != 2 or q_b_weight.shape[1] != Q:
        raise ValueError(f"k26.mla_glue_qb: q_b_weight must be [N, {Q}], got {list(q_b_weight.shape)}")
    if q_b_weight.dtype != q_a.dtype:
        got = f"{q_b_weight.dtype} differs from q_a's {q_a.dtype}"
        raise ValueError(f"k26.mla_glue_qb: q_b_weight dtype {got}")
    if q_b_weight.device != q_a.device:
        raise ValueError(f"k26.mla_glue_qb: q_b_weight is on {q_b_weight.device}, q_a on {q_a.device}")


@functools.cache  # once per process, like build.library
def _lib() -> ctypes.CDLL:
    from .build import library

    lib = library()
    P, I, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.k26_mla_glue_qb.restype = I
    lib.k26_mla_glue_qb.argtypes = [P] * 11 + [LL] * 4 + [I] * 6 + [ctypes.c_float, I, P]
    lib.k26_mla_glue_qb_max_tokens.restype = I
    assert lib.k26_mla_glue_qb_max_tokens() == MAX_TOKENS, "glue_qb_cuda.MAX_TOKENS differs from the kernel's"
    return lib


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _why_not(q_a, kv_a, cache, q_norm_weight, kv_norm_weight, q_b_weight) -> str | None:
    """Why the fused kernel does not take this call (None: it does)."""
    B, N, Q = q_a.shape
    R = kv_norm_weight.shape[0]
    why = _unsupported(q_a, cache, q_norm_weight, kv_norm_weight, R, kv_a.shape[2] - R)
    if why is not None:
        return why
    if not 1 <= B * N <= MAX_TOKENS:
        return f"{B * N} tokens (1 .. {MAX_TOKENS} served)"
    if q_b_weight.stride(1) != 1 or q_b_weight.stride(0) != Q or q_b_weight.data_ptr() % 16:
        return "a q_b weight that is not row-contiguous and 16-byte aligned"
    if _rows(q_a) is None:
        return "q_a rows not 16-byte aligned at a uniform stride"
    index = torch.cuda.current_device() if q_a.device.index is None else q_a.device.index
    blocks = -(-q_b_weight.shape[0] // 16) + B * N
    if blocks > _sms(index):
        return f"{blocks} blocks, more than one wave (the deep tile variant: one block per SM)"
    return None


@torch.library.register_kernel("k26::mla_glue_qb", "cuda")
def _(q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens, q_b):
    glue = (q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, eps, cache, rows, prefix_lens)
    check_qb(glue, q_b)
    why = _why_not(q_a, kv_a, cache, q_norm_weight, kv_norm_weight, q_b)
    if why is not None:
        say_once(__name__, logging.INFO, f"k26.mla_glue_qb: {why} runs mla_glue + linear")
        return torch.ops.k26.linear(torch.ops.k26.mla_glue(*glue), q_b)  # the two ops, as specified
    B, N, Q = q_a.shape
    R = kv_norm_weight.shape[0]
    ins, q_ld, kv_ld, early_ok = kernel_inputs(
        q_a, kv_a, q_norm_weight, kv_norm_weight, positions, inv_freq, rows, prefix_lens
    )
    NQ = q_b.shape[0]
    out = torch.empty(B, N, NQ, dtype=q_a.dtype, device=q_a.device)
    err = _lib().k26_mla_glue_qb(
        *(t.data_ptr() for t in (*ins, cache, q_b, out)),
        q_ld,
        kv_ld,
        cache.stride(0),
        cache.stride(1),
        B * N,
        N,
        Q,
        R,
        kv_a.shape[2] - R,
        NQ,
        float(eps),
        int(early_ok),
        torch.cuda.current_stream(q_a.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"k26.mla_glue_qb: CUDA launch failed with error {err}")
    return out
