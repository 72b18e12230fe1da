"""Front door of `torch.ops.k26.mla_tree_attention_uv` on CUDA: the MLA tree attention followed by the value
up-projection W_UV, two launches. For a sequence of at most 16 query rows (one-token decode at K2.6's TP8 and
TP4 head counts; with a library built with -DK26_ATTN_DEFER_VERIFY up to 128, the TP8 verify tree) whose live
split count is at most `DEFER_MAX_SPLITS`, the attention's splits store their partials and leave, and W_UV's
kernel merges them (csrc/mla_merge_uv.cuh): the kernel boundary stands in for the attention's grid-wide
barrier and merge. Other shapes run `mla_tree_attention` and `linear_grouped`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from . import attention_cuda, pdl
from .log import say_once

# Split counts up to which W_UV merges (4K decode: 65 splits; the per-block merge reads 2 KB a split, so long
# contexts keep the attention's merge spread over all its blocks).
DEFER_MAX_SPLITS = 128


@dataclass(frozen=True)
class MergeBounds:
    """Which calls W_UV's kernel merges, by query rows: a sequence's (its attention tiles must defer, a
    library property), the whole batch's (every merging block reads its row's partials and its W_UV rows,
    so a large batch would read W_UV from L2 once a row, and has few splits a sequence to merge anyway), and
    up to how many a batch its blocks take 32 W_UV rows (four blocks a K2.6 row, each warp's rows loaded
    before the grid-dependency wait) rather than 128 (one block a row, one wave at 128 rows; the rows
    prefetched into L2, loaded after the merge: csrc/mla_merge_uv.cuh). V: a multiple of a block's rows."""

    seq_rows: int
    batch_rows: int
    few_rows: int

    def block_rows(self, B: int, N: int, H: int) -> int:
        return 32 if B * N * H <= self.few_rows else 128


# The default library: one-tile decode (measured: profiling/results/2026-12-07-attention-uv-session41.md).
DECODE = MergeBounds(seq_rows=16, batch_rows=64, few_rows=64)
# A library built with -DK26_ATTN_DEFER_VERIFY: the TP8 verify tree's 16 x 8 rows too (four 32-row tiles).
VERIFY = MergeBounds(seq_rows=128, batch_rows=128, few_rows=32)


@functools.cache  # a property of the loaded library: asked once, not on every call of the op
def merge_bounds(lib) -> MergeBounds:
    return VERIFY if lib.k26_mla_merge_uv_defers_verify() else DECODE


def check_inputs(
    q, cache, rows, prefix_lens, mask_words, w_uv, q_pe=None, positions=None, inv_freq=None
) -> int:
    """Every shape / dtype / device problem as a ValueError naming the argument; returns the key width."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"mla_tree_attention_uv: {msg}")

    need(isinstance(w_uv, torch.Tensor) and w_uv.dim() == 3, "w_uv must be [H, V, latent]")
    try:  # (v_dim 1 is always valid: the latent width is checked below, naming w_uv)
        C = attention_cuda.check_inputs(q, cache, rows, prefix_lens, mask_words, 1, q_pe, positions, inv_freq)
    except ValueError as e:
        raise ValueError(str(e).replace("mla_tree_attention:", "mla_tree_attention_uv:", 1)) from None
    need(0 < w_uv.shape[2] <= C, f"w_uv's latent width {w_uv.shape[2]} must lie in (0, {C}] (the key width)")
    need(w_uv.shape[0] == q.shape[2], f"w_uv has {w_uv.shape[0]} heads, q {q.shape[2]}")
    need(w_uv.dtype == q.dtype, f"w_uv dtype {w_uv.dtype} differs from q's {q.dtype}")
    need(w_uv.device == q.device, f"w_uv is on {w_uv.device}, q on {q.device}")
    return C


def _merge_unsupported(w_uv: torch.Tensor, B: int, N: int, H: int, bounds: MergeBounds) -> str | None:
    """Why W_UV's kernel does not merge for these shapes (None: it does)."""
    if N * H > bounds.seq_rows:
        return f"{N} x {H} query rows a sequence (it merges up to {bounds.seq_rows})"
    if B * N * H > bounds.batch_rows:
        return f"{B} x {N} x {H} query rows a batch (it merges up to {bounds.batch_rows})"
    rows = bounds.block_rows(B, N, H)
    if w_uv.shape[1] % rows:
        return f"{w_uv.shape[1]} value rows a head (not a multiple of {rows})"
    return None


@torch.library.register_kernel("k26::mla_tree_attention_uv", "cuda")
def _(
    q,
    cache,
    rows,
    prefix_lens,
    mask_words,
    scale,
    w_uv,
    static=False,
    q_pe=None,
    positions=None,
    inv_freq=None,
):
    C = check_inputs(q, cache, rows, prefix_lens, mask_words, w_uv, q_pe, positions, inv_freq)
    B, N, H, _ = q.shape
    V, v_dim = w_uv.shape[1], w_uv.shape[2]
    if B * N * H * V == 0:
        return q.new_empty(B, N, H, V)
    bounds = merge_bounds(attention_cuda.library_bound())
    why = attention_cuda.fallback_reason(q, C, v_dim, q_pe) or _merge_unsupported(w_uv, B, N, H, bounds)
    if why is not None:  # the two ops (each runs its own kernel, or its reference where it has none)
        say_once(__name__, logging.INFO, f"k26.mla_tree_attention_uv: {why}: attention and W_UV apart")
        out, _ = torch.ops.k26.mla_tree_attention(
            q, cache, rows, prefix_lens, mask_words, scale, v_dim, static, q_pe, positions, inv_freq
        )
        return torch.ops.k26.linear_grouped(out, w_uv)
    w = w_uv  # rows of 512 contiguous values, 16-B aligned (a view into kv_b's weight is read in place)
    if w.stride(2) != 1 or w.stride(0) % 8 or w.stride(1) % 8 or w.data_ptr() % 16:
        w = w.contiguous()  # (before the attention: a copy between the two launches would break the chain)
    launch = attention_cuda.attend(
        q, cache, rows, prefix_lens, mask_words, scale, q_pe, positions, inv_freq, DEFER_MAX_SPLITS
    )
    y = q.new_empty(B, N, H, V)
    # Under PDL the kernel reads W_UV and the lengths before its grid-dependency wait: the lengths are final
    # by then (every kernel before the attention has completed), W_UV must be the caller's own.
    lib = attention_cuda.library_bound()
    err = lib.k26_mla_merge_uv(
        launch.workspace.data_ptr(),
        launch.out.data_ptr(),
        launch.prefix.data_ptr(),
        w.data_ptr(),
        w.stride(0),
        w.stride(1),
        y.data_ptr(),
        B,
        N,
        H,
        V,
        cache.shape[1],
        launch.splits,
        launch.min_keys,
        DEFER_MAX_SPLITS,
        bounds.block_rows(B, N, H) // 16,  # W_UV rows a warp
        int(pdl.enabled_as_given((w, w_uv))),
        torch.cuda.current_stream(q.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"mla_tree_attention_uv: CUDA launch of the merging W_UV failed with error {err}")
    return y
