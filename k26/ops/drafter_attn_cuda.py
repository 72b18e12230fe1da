"""`torch.ops.k26.drafter_attention`: the DFlash drafter's attention at inference, the block's queries over
each sequence's cached context K/V and the block's own K/V (grouped-query, every key visible), as two CUDA
launches (csrc/drafter_attn.cu: split-KV over the SMs, then the merge). Its reference is the composition
the drafter ran before, gather + concatenate + fp32 einsum softmax (`reference.drafter_attention`).

The kernel serves bf16 with head_dim 64 or 128 and 16-byte aligned rows; anything else (float32 test
models, other head sizes) runs the reference on the same device, said once in the log.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from . import pdl, reference
from .log import say_once
from .packed import packed

# Keys per split at least: a split's fixed cost (Q load, pipeline fill, the partial's write and merge) is a
# couple of 64-key tiles' worth.
MIN_SPLIT_KEYS = 128


@torch.library.custom_op("k26::drafter_attention", mutates_args=())
def drafter_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    check(q, cache_k, cache_v, k_blk, v_blk, rows, ctx_lens)
    check_rows(rows, cache_k)
    return reference.drafter_attention(q, cache_k, cache_v, k_blk, v_blk, rows, ctx_lens, scale)


@drafter_attention.register_fake
def _(q, cache_k, cache_v, k_blk, v_blk, rows, ctx_lens, scale):
    check(
        q, cache_k, cache_v, k_blk, v_blk, rows, ctx_lens
    )  # (host-side: the fake refuses what the op refuses)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def check_rows(rows, cache_k) -> None:
    """Outside a capture only (inside, a check would be kernels in every replay): every row inside the cache
    (the kernel reads there unchecked; the reference wrapped a negative row around onto another)."""
    if reference.capturing():
        return
    if bool(((rows < 0) | (rows >= cache_k.shape[0])).any()):
        raise ValueError(f"drafter_attention: a row is outside the cache's [0, {cache_k.shape[0]})")


def check(q, cache_k, cache_v, k_blk, v_blk, rows, ctx_lens) -> None:
    """Every shape / dtype / device problem as a ValueError naming the argument."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"drafter_attention: {msg}")

    need(q.dim() == 4, f"q must be [B, S, heads, head_dim], got {list(q.shape)}")
    need(q.is_floating_point(), f"q must be floating point, got {q.dtype}")
    B, S, Hq, hd = q.shape
    need(cache_k.dim() == 4, f"cache_k must be [rows, T, kv_heads, head_dim], got {list(cache_k.shape)}")
    Hkv = cache_k.shape[2]
    need(cache_k.shape[3] == hd, f"cache_k head_dim {cache_k.shape[3]} differs from q's {hd}")
    need(Hkv > 0 and Hq % Hkv == 0, f"q's {Hq} heads are not a multiple of cache_k's {Hkv} KV heads")
    need(cache_v.shape == cache_k.shape, f"cache_v {list(cache_v.shape)} differs from cache_k")
    for name, t in (("k_blk", k_blk), ("v_blk", v_blk)):
        need(t.shape == (B, S, Hkv, hd), f"{name} must be [{B}, {S}, {Hkv}, {hd}], got {list(t.shape)}")
    need(rows.shape == (B,) and ctx_lens.shape == (B,), f"rows and ctx_lens must be [B={B}]")
    ints = (torch.int32, torch.int64)
    need(rows.dtype in ints and ctx_lens.dtype in ints, "rows and ctx_lens must be int32 or int64")
    for name, t in (("cache_k", cache_k), ("cache_v", cache_v), ("k_blk", k_blk), ("v_blk", v_blk)):
        need(t.dtype == q.dtype, f"{name} dtype {t.dtype} differs from q's {q.dtype}")
    for name, t in (
        ("cache_k", cache_k),
        ("cache_v", cache_v),
        ("k_blk", k_blk),
        ("v_blk", v_blk),
        ("rows", rows),
        ("ctx_lens", ctx_lens),
    ):
        need(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")


# ---------------------------------------------------------------- launch


@functools.cache  # once per process, like build.library
def _lib() -> ctypes.CDLL:
    from .build import library  # lazily: `python -m k26.ops.build` must not import itself first

    lib = library()
    lib.k26_drafter_attn_plan.restype = ctypes.c_int
    lib.k26_drafter_attn_plan.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.k26_drafter_attn_block_rows.restype = ctypes.c_int
    lib.block_rows = lib.k26_drafter_attn_block_rows()  # the kernel's query rows per block, a constant
    lib.k26_drafter_attn.restype = ctypes.c_int
    lib.k26_drafter_attn.argtypes = (
        [ctypes.c_void_p] * 3
        + [ctypes.c_longlong]
        + [ctypes.c_void_p] * 2
        + [ctypes.c_longlong] * 2
        + [ctypes.c_void_p] * 5
        + [ctypes.c_int] * 8
        + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    )
    return lib


@functools.cache  # per (device, head_dim, tiles): the occupancy and the SM count do not change
def _splits(device: torch.device, head_dim: int, tiles: int) -> int:
    out = ctypes.c_int()
    with torch.cuda.device(device):
        err = _lib().k26_drafter_attn_plan(head_dim, tiles, ctypes.byref(out))
    if err:
        raise RuntimeError(f"drafter_attention: launch planning failed with CUDA error {err}")
    return out.value


def _cache_rows_ok(c: torch.Tensor) -> bool:
    """[rows, T, Hkv, hd] with each row's tokens packed (rows may lie any 16-byte multiple apart: a view of
    the first T slots of a longer cache is read in place)."""
    _, _, Hkv, hd = c.shape
    return (
        c.stride(3) == 1
        and c.stride(2) == hd
        and c.stride(1) == Hkv * hd
        and c.stride(0) % 8 == 0
        and c.data_ptr() % 16 == 0
    )


def _block_tokens(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Block K or V [B, S, Hkv, hd] as the kernel reads it: (tensor, elements between tokens). Tokens may lie
    any 16-byte multiple apart, so a view into the stacked qkv projection's output is read in place;
    anything else is copied packed."""
    B, S, Hkv, hd = t.shape
    st = t.stride()
    tokens_packed = B == 1 or st[0] == S * st[1]
    if st[3] == 1 and st[2] == hd and tokens_packed and st[1] % 8 == 0 and t.data_ptr() % 16 == 0:
        return t, st[1]
    return packed(t), Hkv * hd


def _unsupported(q, cache_k, cache_v) -> str | None:
    from .build import available

    if q.dtype != torch.bfloat16:
        return f"dtype {q.dtype} (the kernel is bf16)"
    if q.shape[3] not in (64, 128):
        return f"head_dim {q.shape[3]} (the kernel has 64 and 128)"
    if not (_cache_rows_ok(cache_k) and _cache_rows_ok(cache_v)) or cache_k.stride(0) != cache_v.stride(0):
        return "a cache whose rows are not packed and 16-byte aligned"
    if not available():
        return "no kernel library"
    return None


@torch.library.register_kernel("k26::drafter_attention", "cuda")
def cuda_drafter_attention(q, cache_k, cache_v, k_blk, v_blk, rows, ctx_lens, scale):
    check(q, cache_k, cache_v, k_blk, v_blk, rows, ctx_lens)
    B, S, Hq, hd = q.shape
    check_rows(rows, cache_k)  # before either path: the reference would wrap a negative row onto another
    why = _unsupported(q, cache_k, cache_v) or (None if B * S * Hq else "an empty batch")
    if why is not None:
        say_once(__name__, logging.INFO, f"k26.drafter_attention: {why} runs the reference")
        return reference.drafter_attention(q, cache_k, cache_v, k_blk, v_blk, rows, ctx_lens, scale)
    T, Hkv = cache_k.shape[1], cache_k.shape[2]
    lib = _lib()
    BM = lib.block_rows
    RT = (S * (Hq // Hkv) + BM - 1) // BM
    S_max = _splits(q.device, hd, B * Hkv * RT)
    qc = packed(q)  # (cp.async reads 16-byte chunks)
    (kb, ldk), (vb, ldv) = _block_tokens(k_blk), _block_tokens(v_blk)
    rows64, lens64 = rows.to(torch.int64).contiguous(), ctx_lens.to(torch.int64).contiguous()
    out = torch.empty_like(qc)
    # Every live split writes its partial before the merge reads it: no zeroing, no counters.
    o_part = torch.empty(B * Hkv * RT * S_max * BM * hd, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B * Hkv * RT * S_max * BM, dtype=torch.float32, device=q.device)
    err = lib.k26_drafter_attn(
        qc.data_ptr(),
        cache_k.data_ptr(),
        cache_v.data_ptr(),
        cache_k.stride(0),
        kb.data_ptr(),
        vb.data_ptr(),
        ldk,
        ldv,
        rows64.data_ptr(),
        lens64.data_ptr(),
        out.data_ptr(),
        o_part.data_ptr(),
        lse_part.data_ptr(),
        B,
        S,
        Hq,
        Hkv,
        hd,
        T,
        S_max,
        MIN_SPLIT_KEYS,
        float(scale),
        int(pdl.ENABLED),
        torch.cuda.current_stream(q.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"k26.drafter_attention: CUDA launch failed with error {err}")
    return out
