"""`torch.ops.k26.*`: schemas, fakes for torch.compile/graph capture, and the reference kernels.

Each op is registered once here with its pure-torch reference as the implementation for every
device; CUDA kernels (later modules) override the "cuda" key without changing the schema.
"""

from __future__ import annotations

import torch

from . import moe_cuda, reference, router_cuda  # noqa: F401  (moe_cuda, router_cuda register their ops)
from .int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from .ref_checks import check_moe_w4a16, check_write_cache
from .reference import causal_words, tree_mask_to_words, words_to_tree_mask

__all__ = [
    "OPS",
    "causal_words",
    "dequantize_int4",
    "pack_int4",
    "quantize_int4",
    "tree_mask_to_words",
    "unpack_int4",
    "words_to_tree_mask",
]


@torch.library.custom_op("k26::moe_w4a16", mutates_args=())
def moe_w4a16(
    x: torch.Tensor,
    gate_packed: torch.Tensor,
    gate_scale: torch.Tensor,
    up_packed: torch.Tensor,
    up_scale: torch.Tensor,
    down_packed: torch.Tensor,
    down_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    check_moe_w4a16(
        x, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, topk_ids, topk_weights
    )
    return reference.moe_w4a16(
        x, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, topk_ids, topk_weights
    )


@moe_w4a16.register_fake
def _(x, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, topk_ids, topk_weights):
    return x.new_empty(x.shape[0], down_packed.shape[1])


@torch.library.custom_op("k26::mla_write_cache", mutates_args=("cache",))
def mla_write_cache(
    cache: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor
) -> None:
    check_write_cache(cache, latent, rows, prefix_lens)
    reference.check_cache_span("mla_write_cache", cache, rows, prefix_lens, latent.shape[1])
    reference.mla_write_cache(cache, latent, rows, prefix_lens)


@mla_write_cache.register_fake
def _(cache, latent, rows, prefix_lens):
    return None


@torch.library.custom_op("k26::mla_tree_attention", mutates_args=())
def mla_tree_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    mask_words: torch.Tensor,
    scale: float,
    v_dim: int,
    static: bool = False,
    q_pe: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The CUDA path's checks (any dtype): the reference ran none (a v_dim past the keys gave their width of
    # values where the fake promised v_dim; wrong mask words or widths were errors from inside torch)
    attention_cuda.check_inputs(q, cache, rows, prefix_lens, mask_words, v_dim, q_pe, positions, inv_freq)
    return reference.mla_tree_attention(
        q, cache, rows, prefix_lens, mask_words, scale, v_dim, static, q_pe, positions, inv_freq
    )


@mla_tree_attention.register_fake
def _(
    q,
    cache,
    rows,
    prefix_lens,
    mask_words,
    scale,
    v_dim,
    static=False,
    q_pe=None,
    positions=None,
    inv_freq=None,
):
    attention_cuda.check_inputs(q, cache, rows, prefix_lens, mask_words, v_dim, q_pe, positions, inv_freq)
    B, N, H, _ = q.shape
    return q.new_empty(B, N, H, v_dim), q.new_empty(B, N, H, dtype=torch.float32)


@torch.library.custom_op("k26::mla_tree_attention_uv", mutates_args=())
def mla_tree_attention_uv(
    q: torch.Tensor,
    cache: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    mask_words: torch.Tensor,
    scale: float,
    w_uv: torch.Tensor,
    static: bool = False,
    q_pe: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor:
    attention_uv_cuda.check_inputs(q, cache, rows, prefix_lens, mask_words, w_uv, q_pe, positions, inv_freq)
    return reference.mla_tree_attention_uv(
        q, cache, rows, prefix_lens, mask_words, scale, w_uv, static, q_pe, positions, inv_freq
    )


@mla_tree_attention_uv.register_fake
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
    attention_uv_cuda.check_inputs(q, cache, rows, prefix_lens, mask_words, w_uv, q_pe, positions, inv_freq)
    B, N, H, _ = q.shape
    return q.new_empty(B, N, H, w_uv.shape[1])


from . import (
    allreduce_cuda,  # noqa: F401  (registers allreduce_add_rmsnorm and add_rmsnorm with their CUDA kernels)
    attention_cuda,  # (registers the CUDA kernel of mla_tree_attention; its checks serve the reference too)
    attention_uv_cuda,  # (registers mla_tree_attention_uv's two launches; its checks serve the reference too)
    drafter_attn_cuda,  # noqa: F401  (registers drafter_attention with its CUDA kernel)
    glue_cuda,  # noqa: F401  (registers mla_glue and mla_glue_linear with their CUDA kernels)
    linear_cuda,  # noqa: F401  (registers linear / linear_grouped with their CUDA kernel)
    moe_block_cuda,  # noqa: F401  (registers moe_one_token with its two launches)
    swiglu_cuda,  # noqa: F401  (registers linear_swiglu with the small-M kernel's SwiGLU mode)
    topk_cuda,  # noqa: F401  (registers logits_topk with its CUDA kernels)
    tree_cuda,  # noqa: F401  (registers ddtree_build with its CUDA kernel)
)

OPS = (
    "moe_w4a16",
    "moe_w4a16_repacked",
    "moe_router",
    "moe_router_table",
    "moe_one_token",
    "mla_write_cache",
    "mla_tree_attention",
    "mla_tree_attention_uv",
    "linear",
    "linear_grouped",
    "linear_swiglu",
    "ddtree_build",
    "logits_topk",
    "mla_glue",
    "mla_glue_linear",
    "allreduce_add_rmsnorm",
    "add_rmsnorm",
    "drafter_attention",
)
