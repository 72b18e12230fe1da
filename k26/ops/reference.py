"""Pure-torch reference implementations of every `torch.ops.k26.*` op: the specification.

They run on any device and follow the precision of the HF reference code (per-expert outputs in the
activation dtype, fp32 weighted sum, one cast; fp32 softmax). They may sync with the host; the
CUDA kernels that replace them on GPU may not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .int4 import dequantize_int4

WORD_BITS = 64  # ancestor bitmask: bit j of word j // 64 in row i says node i sees new token j


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def live_keys(lengths: torch.Tensor, extra: int, capacity: int, static: bool = False) -> int:
    """How many cache slots a reference path reads: the live maximum, or the whole row when `static` (the
    caller's sync-free mode, see `AttnBatch.static`) or inside a CUDA-graph capture."""
    if static or capturing():
        return capacity
    return min(capacity, int(lengths.max()) + extra)


def tree_mask_to_words(mask_BNN: torch.Tensor) -> torch.Tensor:
    """Bool ancestor mask [B, N, N] -> int64 words [B, N, ceil(N / 64)]."""
    B, N, _ = mask_BNN.shape
    W = (N + WORD_BITS - 1) // WORD_BITS
    padded = F.pad(mask_BNN, (0, W * WORD_BITS - N)).view(B, N, W, WORD_BITS).long()
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


def mla_tree_attention(
    q_BNHC, cache_RLC, rows_B, prefix_lens_B, words_BNW, scale: float, v_dim: int, static: bool = False
):
    """Absorbed MLA over the latent cache: one shared 576-wide key per token, values its first v_dim.
    `static`: whole cache rows, no host sync (`live_keys`).

    Returns out [B, N, H, v_dim] in q's dtype and the fp32 log-sum-exp [B, N, H].
    """
    _, N, _, _ = q_BNHC.shape
    if not (static or capturing()) and int(prefix_lens_B.max()) + N > cache_RLC.shape[1]:
        raise ValueError(
            f"mla_tree_attention: prefix + {N} new tokens exceeds cache length {cache_RLC.shape[1]}"
        )
    keys = live_keys(prefix_lens_B, N, cache_RLC.shape[1], static)
    kv_BLC = cache_RLC[rows_B, :keys].float()
    s_BNHL = torch.einsum("bnhc,blc->bnhl", q_BNHC.float(), kv_BLC) * scale
    vis_BNL = visible_keys(prefix_lens_B, words_BNW, N, keys)
    s_BNHL = s_BNHL.masked_fill(~vis_BNL[:, :, None, :], float("-inf"))
    lse_BNH = torch.logsumexp(s_BNHL, dim=-1)
    p_BNHL = torch.exp(s_BNHL - lse_BNH[..., None])
    out = torch.einsum("bnhl,blv->bnhv", p_BNHL, kv_BLC[..., :v_dim])
    return out.to(q_BNHC.dtype), lse_BNH


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
