"""Pure-torch reference implementations of every `torch.ops.k26.*` op: the specification.

They run on any device and follow the precision of the HF reference code (per-expert outputs in the
activation dtype, fp32 weighted sum, one cast; fp32 softmax). They may sync with the host; the
CUDA kernels that replace them on GPU may not.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from .int4 import dequantize_int4

WORD_BITS = 64  # ancestor bitmask: bit j of word j // 64 in row i says node i sees new token j


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# The spans a forward checked once (`spans_checked`): what its per-layer ops would check again, each a device
# sync on CUDA (a K2.6 forward: two a layer, 122 per prefill chunk). A ContextVar: scoped to the `with` block
# of the thread / task that set it, like torch.no_grad — never a process-wide switch.
_CHECKED: ContextVar[tuple | None] = ContextVar("k26_spans_checked", default=None)


def _span_key(cache, rows, prefix_lens, n: int) -> tuple:
    """The tensors as they are now: other tensors in their place (pointer, shape, strides) or a write into
    rows or prefix_lens (their version; inference-mode tensors keep none, and nothing inside a forward writes
    its batch) is a different key."""
    key: tuple = (n, tuple(cache.shape[:2]))
    for x in (rows, prefix_lens):
        key += ((x.data_ptr(), x.shape, x.stride(), -1 if x.is_inference() else x._version),)
    return key


@contextmanager
def spans_checked(op: str, cache, rows, prefix_lens, n: int):
    """Check every span of a forward's batch once (`check_cache_span`, as `op`); inside the block the
    per-layer ops skip the same check of the same tensors (caches of the same rows x length). The block must
    not write rows or prefix_lens in place: under inference mode (the engine's) such a write goes unseen."""
    check_cache_span(op, cache, rows, prefix_lens, n)
    token = _CHECKED.set(None if capturing() else _span_key(cache, rows, prefix_lens, n))
    try:
        yield
    finally:
        _CHECKED.reset(token)


def spans_bad(cache, rows, prefix_lens, n: int) -> bool:
    """A row outside the cache, a negative prefix or a span past its row (a device sync on CUDA)."""
    bad = (prefix_lens < 0) | (prefix_lens + n > cache.shape[1]) | (rows < 0) | (rows >= cache.shape[0])
    return bool(bad.any())


def check_cache_span(op: str, cache, rows, prefix_lens, n: int) -> None:
    """Outside a CUDA-graph capture (inside, a check would be kernels in every replay): every row inside the
    cache and every prefix_lens .. prefix_lens + n span inside its row — the kernels write and read there
    unchecked (a negative row wrapped around in the references). A device sync on CUDA, unless the forward
    around the call checked these spans already (`spans_checked`)."""
    if capturing():
        return
    done = _CHECKED.get()
    if done is not None and done == _span_key(cache, rows, prefix_lens, n):
        return
    if spans_bad(cache, rows, prefix_lens, n):
        raise ValueError(
            f"{op}: prefix_lens + {n} exceeds the cache length {cache.shape[1]}, a prefix length is "
            f"negative, or a row is outside [0, {cache.shape[0]})"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF precision: normalise in fp32, round to x's dtype, then multiply by the weight (the arithmetic of
    k26.model.layers.RMSNorm and of every kernel that fuses an RMSNorm)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def live_keys(lengths: torch.Tensor, extra: int, capacity: int, static: bool = False) -> int:
    """How many cache slots a reference path reads: the live maximum, or the whole row when `static` (the
    caller's sync-free mode, see `AttnBatch.static`) or inside a CUDA-graph capture."""
    if static or capturing():
        return capacity
    if not lengths.numel():  # an empty batch reads nothing (max() of nothing is an error)
        return min(capacity, extra)
    return min(capacity, int(lengths.max()) + extra)


def tree_mask_to_words(mask_BNN: torch.Tensor) -> torch.Tensor:
    """Bool ancestor mask [B, N, K] (K = N: a whole tree; K > N: some rows of one) -> int64 words
    [B, N, ceil(K / 64)]."""
    B, N, K = mask_BNN.shape
    W = (K + WORD_BITS - 1) // WORD_BITS
    padded = F.pad(mask_BNN, (0, W * WORD_BITS - K)).view(B, N, W, WORD_BITS).long()
    shifts = torch.arange(WORD_BITS, device=mask_BNN.device, dtype=torch.long)
    # Distinct powers of two: the sum is the OR, and bit 63 lands in the sign bit as intended.
    return (padded << shifts).sum(-1)


def words_to_tree_mask(words_BNW: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(WORD_BITS, device=words_BNW.device, dtype=torch.long)
    bits = (words_BNW.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :n].bool()


def causal_words(b: int, n: int, device: torch.device | str) -> torch.Tensor:
    tri = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return tree_mask_to_words(tri.expand(b, n, n))


def visible_keys(prefix_lens_B: torch.Tensor, words_BNW: torch.Tensor, n: int, keys: int) -> torch.Tensor:
    """[B, N, keys] bool: the whole prefix is visible, new token j only where the ancestor bit is set."""
    tree_BNN = words_to_tree_mask(words_BNW, n)
    j_BL = torch.arange(keys, device=prefix_lens_B.device)[None, :] - prefix_lens_B[:, None]
    in_tree_BL = (j_BL >= 0) & (j_BL < n)
    idx = j_BL.clamp(0, n - 1)[:, None, :].expand(-1, n, -1)
    tree_vis = tree_BNN.gather(2, idx) & in_tree_BL[:, None, :]
    return (j_BL < 0)[:, None, :] | tree_vis


def mla_write_cache(cache_RLC, latent_BNC, rows_B, prefix_lens_B) -> None:
    """cache[rows[b], prefix_lens[b] + n] = latent[b, n]."""
    n = latent_BNC.shape[1]
    pos_BN = prefix_lens_B[:, None] + torch.arange(n, device=latent_BNC.device)
    cache_RLC[rows_B[:, None], pos_BN] = latent_BNC.to(cache_RLC.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE: x [..., P] with positions broadcastable to x.shape[:-1], inv_freq fp32 [P/2]."""
    ang = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = ang.cos(), ang.sin()
    x2 = x.float().unflatten(-1, (-1, 2))
    x0, x1 = x2[..., 0], x2[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def attention_query(q_BNHC, q_pe_BNHP=None, positions_BN=None, inv_freq=None) -> torch.Tensor:
    """mla_tree_attention's query: q itself, or with q_pe (the rotary part, before RoPE) the concatenation
    [q, rope(q_pe, positions, inv_freq)]."""
    if q_pe_BNHP is None:
        return q_BNHC
    return torch.cat([q_BNHC, rope(q_pe_BNHP, positions_BN[:, :, None], inv_freq)], dim=-1)


def mla_tree_attention(
    q_BNHC,
    cache_RLC,
    rows_B,
    prefix_lens_B,
    words_BNW,
    scale: float,
    v_dim: int,
    static: bool = False,
    q_pe_BNHP=None,
    positions_BN=None,
    inv_freq=None,
):
    """Absorbed MLA over the latent cache: one shared 576-wide key per token, values its first v_dim.
    `static`: whole cache rows, no host sync (`live_keys`). With q_pe, q holds the query's first dims and
    q_pe its rotary part before RoPE (`attention_query`): the caller's rope and concatenation, fused.

    Returns out [B, N, H, v_dim] in q's dtype and the fp32 log-sum-exp [B, N, H].
    """
    q_BNHC = attention_query(q_BNHC, q_pe_BNHP, positions_BN, inv_freq)
    _, N, _, _ = q_BNHC.shape
    if not static:  # (the sync-free mode reads whole rows and checks nothing)
        check_cache_span("mla_tree_attention", cache_RLC, rows_B, prefix_lens_B, N)
    keys = live_keys(prefix_lens_B, N, cache_RLC.shape[1], static)
    vis_BNL = visible_keys(prefix_lens_B, words_BNW, N, keys)
    # Slots no query sees (past a shorter row's prefix, or the whole row when static) may hold anything,
    # NaN included, and a zero probability times NaN is NaN: they are read as zeros.
    kv_BLC = cache_RLC[rows_B, :keys].float().masked_fill(~vis_BNL.any(1)[..., None], 0.0)
    s_BNHL = torch.einsum("bnhc,blc->bnhl", q_BNHC.float(), kv_BLC) * scale
    s_BNHL = s_BNHL.masked_fill(~vis_BNL[:, :, None, :], float("-inf"))
    lse_BNH = torch.logsumexp(s_BNHL, dim=-1)
    p_BNHL = torch.exp(s_BNHL - lse_BNH[..., None])
    out = torch.einsum("bnhl,blv->bnhv", p_BNHL, kv_BLC[..., :v_dim])
    return out.to(q_BNHC.dtype), lse_BNH


def mla_tree_attention_uv(q_BNHC, cache_RLC, rows_B, prefix_lens_B, words_BNW, scale, w_uv_HVR, *rotary):
    """`mla_tree_attention`'s output (in q's dtype, as the model would hold it) through each head's value
    up-projection: y[b, n, h] = W_UV[h] o[b, n, h]. `rotary`: its trailing arguments (static, q_pe,
    positions, inv_freq). Returns [B, N, H, V]."""
    attn = (q_BNHC, cache_RLC, rows_B, prefix_lens_B, words_BNW, scale)
    o_BNHR, _ = mla_tree_attention(*attn, w_uv_HVR.shape[2], *rotary)
    return torch.einsum("bnhr,hvr->bnhv", o_BNHR, w_uv_HVR).contiguous()


def gqa_attention(q_BSHD, k_BLKD, v_BLKD, visible_BSL: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention, fp32 scores and softmax, the probabilities rounded to v's dtype before P V:
    query head h reads KV head h // (H / K). visible_BSL: [B, S or 1, L] keys each query sees (each query
    must see one). Keys no query sees may hold anything, NaN included: their values are read as zeros."""
    rep = q_BSHD.shape[2] // k_BLKD.shape[2]
    v_BLKD = v_BLKD.masked_fill(~visible_BSL.any(1)[:, :, None, None], 0.0)
    k, v = k_BLKD.repeat_interleave(rep, dim=2), v_BLKD.repeat_interleave(rep, dim=2)
    s = torch.einsum("bshd,blhd->bhsl", q_BSHD.float(), k.float()) * scale
    s = s.masked_fill(~visible_BSL[:, None], float("-inf"))
    return torch.einsum("bhsl,blhd->bshd", torch.softmax(s, dim=-1).to(v.dtype), v)


def drafter_attention(q_BSHD, cache_k_RTKD, cache_v_RTKD, k_blk_BSKD, v_blk_BSKD, rows_B, ctx_lens_B, scale):
    """The DFlash drafter at inference: the block's queries over the cached context rows cache[rows[b],
    0 .. ctx_lens[b]) (clamped to the cache length T) and the block's own S keys, all visible."""
    T, S = cache_k_RTKD.shape[1], q_BSHD.shape[1]
    k = torch.cat([cache_k_RTKD[rows_B], k_blk_BSKD], dim=1)  # [B, T + S, K, D]
    v = torch.cat([cache_v_RTKD[rows_B], v_blk_BSKD], dim=1)
    j = torch.arange(T + S, device=q_BSHD.device)
    visible = (j[None] < ctx_lens_B.clamp(0, T)[:, None]) | (j[None] >= T)
    return gqa_attention(q_BSHD, k, v, visible[:, None], scale).contiguous()


def moe_router(
    x_TD, weight_ED, bias_E, n_group: int, topk_group: int, topk: int, renormalize: bool, scale: float
):
    """noaux_tc routing: the biased sigmoid scores choose (group-limited top-k), the unbiased ones weight.

    Returns fp32 weights [T, topk] (renormalised if asked, times `scale`) and int64 ids [T, topk].
    """
    scores_TE = F.linear(x_TD.float(), weight_ED.float()).sigmoid()
    choice_TE = scores_TE + bias_E
    if n_group > 1:
        grouped = choice_TE.unflatten(-1, (n_group, -1))
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(-1, group_score.topk(topk_group, dim=-1).indices, True)
        # -inf, not 0: a masked expert must never win even when every biased score is negative.
        choice_TE = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
    ids_TK = choice_TE.topk(topk, dim=-1).indices
    w_TK = scores_TE.gather(-1, ids_TK)
    if renormalize:
        w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
    return w_TK * scale, ids_TK


def expert_mlp(x_TD, w_gate_ID, w_up_ID, w_down_DI):
    return F.linear(F.silu(F.linear(x_TD, w_gate_ID)) * F.linear(x_TD, w_up_ID), w_down_DI)


def moe_combine(x_TD, ids_TK, weights_TK, expert_weights) -> torch.Tensor:
    """Σ_k w[t,k] · Expert_{ids[t,k]}(x[t]); `expert_weights(e)` yields (gate, up, down) in x's dtype."""
    out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for e in torch.unique(ids_TK).tolist():
        tok, k = (ids_TK == e).nonzero(as_tuple=True)
        y = expert_mlp(x_TD[tok], *expert_weights(e))
        out_TD.index_add_(0, tok, y.float() * weights_TK[tok, k, None].float())
    return out_TD.to(x_TD.dtype)


def moe_w4a16(
    x_TD, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, ids_TK, weights_TK
):
    """Routed experts with int4 group-32 weights in the compressed-tensors layout, stacked over E."""

    def weights(e: int):
        return (
            dequantize_int4(gate_packed[e], gate_scale[e], x_TD.dtype),
            dequantize_int4(up_packed[e], up_scale[e], x_TD.dtype),
            dequantize_int4(down_packed[e], down_scale[e], x_TD.dtype),
        )

    return moe_combine(x_TD, ids_TK, weights_TK, weights)


# ------------------------------------------------ vocabulary top-k (torch.ops.k26.logits_topk)


def logits_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [..., V] (as fp32), descending, and their columns (int64): equal
    values in column order, NaN above everything, -0.0 equal to +0.0 (a stable descending sort); and each
    row's log-sum-exp [...] (fp32). What the draft reads of its vocabulary shard."""
    x = x.float()
    v, i = torch.sort(x, dim=-1, descending=True, stable=True)
    return v[..., :k].contiguous(), i[..., :k].contiguous(), torch.logsumexp(x, dim=-1)
