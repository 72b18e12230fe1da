"""Multi-head latent attention: the naive form (reference) beside the weight-absorbed form (serving).

Both read keys and values from the same latent cache (c_kv after kv_a_layernorm, then k_pe after RoPE;
576 values per token per layer for K2), so they agree for any mask up to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops import glue_cuda, reference  # noqa: F401  (glue_cuda registers torch.ops.k26.mla_glue)
from ..ops.linear_cuda import MAX_ROWS
from .batch import AttnBatch
from .layers import RMSNorm, TPInfo, linear, stack_
from .rope import Rope

# Token rows up to which `fuse_` routes MLA's projections through torch.ops.k26.linear instead of cuBLAS,
# where the compiled, graph-replayed K2.6 step measured it faster
# (profiling/results/2026-12-01-bench_k26-glue-h200.md): the stacked q_a / kv_a and W_UK won or tied at
# 1 and 16 rows; q_b and W_UV (short K) won at 1 row and lost at 16 under split-K, and win at 16 in tile
# mode (q_b 4.3 vs cuBLAS 4.9 µs, W_UV 2.7 vs 3.2: 2026-12-01-bench_linear-h200-tile.md); o_proj (short K too)
# tied at 1 row and won at 16 (the 61-layer step on an H100: decode 4.50 -> 4.51 ms, verify N = 16 7.41 ->
# 7.23; 2026-12-05-moe-two-launch-session25-h100.md). Tile mode is batch-invariant (in launches of 64 rows
# too), so every MLA projection runs it for every decode / verify batch: a verify step then reproduces
# decode's MLA bit for bit (cuBLAS picks its algorithm by M). The dense MLP and the head are still cuBLAS.
KERNEL_MAX_M = SHORT_K_MAX_M = MAX_ROWS  # every decode / verify batch (linear_cuda.MAX_ROWS)
# A prefill (AttnBatch.prefill) needs no bit-equality with any other forward: above 64 rows it takes cuBLAS,
# 2-4x faster there than tile mode (every 16-row block re-reads x).
PREFILL_KERNEL_MAX_M = 64


class MLA(nn.Module):
    glue: bool = True  # torch.ops.k26.mla_glue with a cache; False: the module composition (benchmarks)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TPInfo):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        d, r = cfg.hidden_size, cfg.kv_lora_rank
        self.q_a_proj = linear(d, cfg.q_lora_rank, dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, dtype)
        self.q_b_proj = linear(cfg.q_lora_rank, self.heads * cfg.qk_head_dim, dtype)
        self.kv_a_proj_with_mqa = linear(d, r + cfg.qk_rope_head_dim, dtype)
        self.kv_a_layernorm = RMSNorm(r, cfg.latent_norm_eps, dtype)
        self.kv_b_proj = linear(r, self.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype)
        self.o_proj = linear(self.heads * cfg.v_head_dim, d, dtype)
        # Set by `fuse_`: q_a and kv_a stacked into one matrix (the two weights become views of it), W_UK^T
        # per head [H, r, nope] contiguous for the grouped kernel, and up to how many token rows the small-M
        # kernel runs them (0: cuBLAS / einsum).
        # Buffers, not attributes: torch.compile then takes them as inputs, one body for every layer.
        self.register_buffer("qkv_a", None, persistent=False)
        self.register_buffer("w_uk_t", None, persistent=False)
        self.kernel_max_m = self.short_k_max_m = 0

    @torch.no_grad()
    def fuse_(self, kernel_max_m: int = KERNEL_MAX_M, short_k_max_m: int = SHORT_K_MAX_M) -> None:
        """Stack q_a / kv_a (same input: one projection) and lay W_UK^T out once, after the weights are
        loaded; `kernel_max_m` rows and fewer run the stacked projection and W_UK in the small-M linear
        kernel, `short_k_max_m` rows and fewer also q_b, W_UV and o_proj. Both weights stay parameters under
        their own names (views of the stack: no extra memory); W_UK^T is a copy (1 MB a layer at TP8), so call
        this once the weights are final (inference)."""
        if self.qkv_a is None:
            self.qkv_a = stack_(self.q_a_proj, self.kv_a_proj_with_mqa)
            nope, r = self.cfg.qk_nope_head_dim, self.cfg.kv_lora_rank
            w_uk = self.kv_b_proj.weight.view(self.heads, nope + self.cfg.v_head_dim, r)[:, :nope]
            self.w_uk_t = w_uk.transpose(1, 2).contiguous()
        self.kernel_max_m, self.short_k_max_m = kernel_max_m, short_k_max_m

    def _project_a(self, x_BND: torch.Tensor, small: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """q_a and kv_a projections (raw, before their norms): one stacked matmul after `fuse_` (`small`:
        in the small-M kernel)."""
        if self.qkv_a is None:
            return self.q_a_proj(x_BND), self.kv_a_proj_with_mqa(x_BND)
        a = torch.ops.k26.linear(x_BND, self.qkv_a) if small else F.linear(x_BND, self.qkv_a)
        return a.split([self.cfg.q_lora_rank, a.shape[-1] - self.cfg.q_lora_rank], dim=-1)

    def forward(
        self, x_BND, batch: AttnBatch, cache_RLC: torch.Tensor | None, rope: Rope, absorb=True, partial=False
    ):
        """Attention of the new tokens over the cache (written first); with no cache (training) over the new
        tokens alone, in the naive form, with prefix lengths 0. `partial`: this rank's share, unreduced (the
        caller reduces it with the residual add and the next norm, `TPInfo.reduce_add_norm`)."""
        reduce = (lambda y: y) if partial else self.tp.reduce
        cfg = self.cfg
        B, N, _ = x_BND.shape
        H, nope, r = self.heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        rows = B * N
        kernel = not batch.prefill or rows <= PREFILL_KERNEL_MAX_M  # see the top
        small, short = kernel and rows <= self.kernel_max_m, kernel and rows <= self.short_k_max_m
        q_a, kv_a = self._project_a(x_BND, small)
        latent_BNC = None
        if cache_RLC is not None and self.glue:  # one kernel: both norms, k_pe's RoPE, the cache write
            glue = (
                q_a,
                kv_a,
                self.q_a_layernorm.weight,
                self.kv_a_layernorm.weight,
                batch.positions_BN,
                rope.inv_freq,
                cfg.latent_norm_eps,
                cache_RLC,
                batch.rows_B,
                batch.prefix_lens_B,
            )
            # With the small-M kernel the q_b projection joins the glue's launch where that measured faster
            # (one token: glue_cuda.GLUE_LINEAR_MAX_TOKENS; else the op runs the two kernels), with the two
            # kernels' bits at K2.6's widths (csrc/mla_glue_linear.cu says when).
            if short:
                q_b = torch.ops.k26.mla_glue_linear(*glue, self.q_b_proj.weight)
            else:
                q_b = self.q_b_proj(torch.ops.k26.mla_glue(*glue))
        else:  # the same composition in modules (differentiable: the training forward takes this path)
            q_a = self.q_a_layernorm(q_a)
            c_kv = self.kv_a_layernorm(kv_a[..., :r])
            latent_BNC = torch.cat([c_kv, rope(kv_a[..., r:], batch.positions_BN)], dim=-1)
            q_b = torch.ops.k26.linear(q_a, self.q_b_proj.weight) if short else self.q_b_proj(q_a)
        q_BNHQ = q_b.view(B, N, H, cfg.qk_head_dim)
        q_nope, q_pe_raw = q_BNHQ.split([nope, cfg.qk_rope_head_dim], dim=-1)
        q_pe = rope(q_pe_raw, batch.positions_BN[:, :, None]) if cache_RLC is None or not absorb else None
        if cache_RLC is None:  # no cache (training): the new tokens attend among themselves, differentiably
            vis_BNN = reference.words_to_tree_mask(batch.mask_words_BNW, N)
            o_BNHV = self._attend_latent(q_nope, q_pe, latent_BNC, vis_BNN)
            return reduce(self.o_proj(o_BNHV.reshape(B, N, H * cfg.v_head_dim)))
        if latent_BNC is not None:
            torch.ops.k26.mla_write_cache(cache_RLC, latent_BNC, batch.rows_B, batch.prefix_lens_B)

        w_kv = self.kv_b_proj.weight.view(H, nope + cfg.v_head_dim, r)
        if absorb:
            # q̃ = q_nope · W_UK lets every head score against the single shared latent key.
            if small and self.w_uk_t is not None:
                q_lat = torch.ops.k26.linear_grouped(q_nope, self.w_uk_t)
            else:
                q_lat = torch.einsum("bnhd,hdr->bnhr", q_nope, w_kv[:, :nope])
            # q_pe's RoPE and the concatenation [q̃, rope(q_pe)] run inside the attention kernel.
            words, scale = batch.mask_words_BNW, cfg.softmax_scale
            attn = (q_lat, cache_RLC, batch.rows_B, batch.prefix_lens_B, words, scale)
            rot = (batch.static, q_pe_raw, batch.positions_BN, rope.inv_freq)
            w_uv = w_kv[:, nope:]  # W_UV per head: kv_b's rows as a strided view, no copy
            if self.kv_b_proj.use_kernel or short:
                # one op: on CUDA W_UV's kernel merges short decode's attention splits (attention_uv_cuda)
                o_BNHV = torch.ops.k26.mla_tree_attention_uv(*attn, w_uv, *rot)
            else:
                o_lat, _ = torch.ops.k26.mla_tree_attention(*attn, r, *rot)
                o_BNHV = torch.einsum("bnhr,hvr->bnhv", o_lat.to(x_BND.dtype), w_uv)
        else:
            o_BNHV = self._naive(q_nope, q_pe, batch, cache_RLC)
        o_BNO = o_BNHV.reshape(B, N, H * cfg.v_head_dim)
        return reduce(torch.ops.k26.linear(o_BNO, self.o_proj.weight) if short else self.o_proj(o_BNO))

    def _naive(self, q_nope, q_pe, batch: AttnBatch, cache_RLC):
        """Expand every visible latent row of the cache into per-head k_nope / v and attend as plain MHA."""
        N = q_nope.shape[1]
        keys = int(batch.prefix_lens_B.max()) + N
        lat_BLC = cache_RLC[batch.rows_B, :keys].to(q_nope.dtype)
        vis_BNL = reference.visible_keys(batch.prefix_lens_B, batch.mask_words_BNW, N, keys)
        return self._attend_latent(q_nope, q_pe, lat_BLC, vis_BNL)

    def _attend_latent(self, q_nope, q_pe, lat_BLC, vis_BNL):
        cfg = self.cfg
        B, _, H, _ = q_nope.shape
        nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        kv_BLHX = self.kv_b_proj(lat_BLC[..., :r]).view(B, lat_BLC.shape[1], H, nope + cfg.v_head_dim)
        k_nope, v_BLHV = kv_BLHX.split([nope, cfg.v_head_dim], dim=-1)
        k_BLHQ = torch.cat([k_nope, lat_BLC[..., None, r:].expand(-1, -1, H, -1)], dim=-1)
        q_BNHQ = torch.cat([q_nope, q_pe], dim=-1)
        s_BHNL = torch.einsum("bnhq,blhq->bhnl", q_BNHQ.float(), k_BLHQ.float()) * cfg.softmax_scale
        s_BHNL = s_BHNL.masked_fill(~vis_BNL[:, None], float("-inf"))
        p_BHNL = torch.softmax(s_BHNL, dim=-1).to(q_nope.dtype)
        return torch.einsum("bhnl,blhv->bnhv", p_BHNL, v_BLHV)
