"""The DFlash drafter (Kimi-K2.5/K2.6 DFlash format): Qwen3-style layers conditioned on target features.

Context rows (target hidden states of `target_layer_ids`, concatenated, through fc + hidden_norm) exist
only as per-layer K/V in the drafter cache; the block `[bonus, MASK x (B-1)]` is embedded with the
target's embedding, attends non-causally to all cached context and to itself, and its last B-1 hidden
states go through the target's lm_head. RoPE is NeoX (half-split) over the full head_dim, with YaRN
frequencies and the attention factor on cos/sin (legacy by default, see DrafterConfig).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..compiling import compile_static
from ..drafter_config import DrafterConfig
from ..ops import drafter_attn_cuda  # noqa: F401  (registers torch.ops.k26.drafter_attention)
from ..ops.reference import gqa_attention, live_keys
from .layers import KERNEL_MAX_ROWS, MLP, RMSNorm, TPInfo, linear, project, stack_, use_linear_kernel
from .rope import yarn_inv_freq


class NeoxRope(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", yarn_inv_freq(cfg.rope, cfg.head_dim).float(), persistent=False)

    def reset_buffers(self) -> None:
        self.inv_freq = yarn_inv_freq(self.cfg.rope, self.cfg.head_dim).float().to(self.inv_freq.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, hd], positions [B, T]."""
        ang = positions.float()[..., None, None] * self.inv_freq
        m = self.cfg.attention_factor
        cos, sin = ang.cos() * m, ang.sin() * m
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DrafterAttention(nn.Module):
    """GQA with q/k norms; under TP each rank holds heads/tp query and kv_heads/tp KV heads."""

    def __init__(self, cfg: DrafterConfig, dtype: torch.dtype, tp: TPInfo):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        D, hd = cfg.hidden_size, cfg.head_dim
        self.heads = tp.split(cfg.num_attention_heads, "drafter num_attention_heads")
        self.kv_heads = tp.split(cfg.num_key_value_heads, "drafter num_key_value_heads")
        self.q_proj = linear(D, self.heads * hd, dtype)
        self.k_proj = linear(D, self.kv_heads * hd, dtype)
        self.v_proj = linear(D, self.kv_heads * hd, dtype)
        self.o_proj = linear(self.heads * hd, D, dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.qkv: torch.Tensor | None = None  # fuse_: [q; k; v] stacked, one GEMM for the three

    def fuse_(self) -> None:
        """Stack q / k / v (same input: one launch for the three, in cuBLAS or the small-M kernel as q_proj's
        `kernel_for` says at call time; `stack_`), as `MLP.fuse_`."""
        if self.qkv is None:
            self.qkv = stack_(self.q_proj, self.k_proj, self.v_proj)

    def kv(self, h_BTD: torch.Tensor, pos_BT: torch.Tensor, rope: NeoxRope):
        """Keys (normed, rotated) and values [B, T, kv_heads, hd] of rows h (one GEMM after `fuse_`)."""
        if self.qkv is None:
            return self._kv_heads(self.k_proj(h_BTD), self.v_proj(h_BTD), pos_BT, rope)
        kv = self.qkv[self.heads * self.cfg.head_dim :]  # the K and V rows: a contiguous view
        k, v = project(h_BTD, kv, self.q_proj.kernel_for(h_BTD)).chunk(2, dim=-1)
        return self._kv_heads(k, v, pos_BT, rope)

    def _kv_heads(self, k_BTX, v_BTX, pos_BT, rope: NeoxRope):
        B, T, _ = k_BTX.shape
        hd = self.cfg.head_dim
        return rope(self.k_norm(k_BTX.view(B, T, -1, hd)), pos_BT), v_BTX.view(B, T, -1, hd)

    def project(self, h_BSD: torch.Tensor, pos_BS: torch.Tensor, rope: NeoxRope):
        """The block's queries [B, S, heads, hd] and its own keys and values [B, S, kv_heads, hd] (one GEMM
        for the three after `fuse_`)."""
        B, S, _ = h_BSD.shape
        hd = self.cfg.head_dim
        if self.qkv is None:
            q = rope(self.q_norm(self.q_proj(h_BSD).view(B, S, -1, hd)), pos_BS)
            return (q, *self.kv(h_BSD, pos_BS, rope))
        kv = self.kv_heads * hd
        qkv = project(h_BSD, self.qkv, self.q_proj.kernel_for(h_BSD))
        q, k, v = qkv.split([self.heads * hd, kv, kv], dim=-1)
        q = rope(self.q_norm(q.view(B, S, -1, hd)), pos_BS)
        return (q, *self._kv_heads(k, v, pos_BS, rope))

    def output(self, a_BSHD: torch.Tensor, partial: bool) -> torch.Tensor:
        y = self.o_proj(a_BSHD.flatten(2))
        return y if partial else self.tp.reduce(y)  # partial: the caller reduces (TPInfo.reduce_add_norm)

    def forward(self, h_BSD, pos_BS, ctx_k, ctx_v, visible, rope: NeoxRope, partial: bool = False):
        """Block queries over explicit context K/V [B, L, kv_heads, hd] and the block's own. `visible`: [B, L]
        context rows each query sees, the block seen whole (one block per row); or [B, S, L + S] per query
        (training: many blocks per row, each seeing its own context prefix and itself)."""
        B, S, _ = h_BSD.shape
        q, k_blk, v_blk = self.project(h_BSD, pos_BS, rope)
        k, v = torch.cat([ctx_k, k_blk], dim=1), torch.cat([ctx_v, v_blk], dim=1)  # [B, L + S, kv_heads, hd]
        if visible.dim() == 2:
            visible = torch.cat([visible, visible.new_ones(B, S)], dim=1)[:, None]  # [B, 1, L + S]
        return self.output(gqa_attention(q, k, v, visible, self.cfg.head_dim**-0.5), partial)

    def cached(self, h_BSD, pos_BS, cache_k, cache_v, rows_B, ctx_lens_B, rope: NeoxRope, partial=False):
        """Inference: the block over its sequence's cached context, one layer's cache [rows, T, kv_heads, hd]
        with rows[b]'s first ctx_lens[b] slots live, as `torch.ops.k26.drafter_attention` (on CUDA a
        split-KV kernel that reads the cache in place; the reference gathers)."""
        q, k_blk, v_blk = self.project(h_BSD, pos_BS, rope)
        scale = self.cfg.head_dim**-0.5
        a = torch.ops.k26.drafter_attention(q, cache_k, cache_v, k_blk, v_blk, rows_B, ctx_lens_B, scale)
        return self.output(a, partial)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, dtype: torch.dtype, tp: TPInfo):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DrafterAttention(cfg, dtype, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg.hidden_size, tp.split(cfg.intermediate_size, "drafter intermediate_size"), dtype)

    def forward(self, x_BSD, pos_BS, ctx_k, ctx_v, visible, rope: NeoxRope) -> torch.Tensor:
        """One pre-norm residual layer over explicit context K/V, `visible` as in `DrafterAttention.forward`
        (training; inference runs `DFlashDrafter.forward` over the cache)."""

        def attend(normed):
            return self.self_attn(normed, pos_BS, ctx_k, ctx_v, visible, rope, partial=True)

        return self.fused(x_BSD, self.input_layernorm(x_BSD), attend, None)[1]

    def fused(self, x_BSD, normed, attend, next_norm: RMSNorm | None):
        """The layer given its input norm `normed` and `attend` (normed -> the attention's partial output)
        -> (next_norm(x'), x'): each all-reduce runs with the residual add and the norm after it
        (`TPInfo.reduce_add_norm`); next_norm None: (None, x')."""
        a = attend(normed)
        normed, x_BSD = self.tp.reduce_add_norm(a, x_BSD, self.post_attention_layernorm)
        h = self.mlp(normed)
        if next_norm is None:
            return None, x_BSD + self.tp.reduce(h)
        return self.tp.reduce_add_norm(h, x_BSD, next_norm)


class DFlashDrafter(nn.Module):
    """Attention heads and the MLP are split across TP ranks; fc is row-parallel (each rank holds the columns
    of its slice of the concatenated target features, the sum is all-reduced: at K2.6's 6 x 7168 inputs
    that is 616 MB a step read by every rank otherwise); the norms are replicated."""

    def __init__(self, cfg: DrafterConfig, dtype: torch.dtype = torch.bfloat16, tp: TPInfo = TPInfo()):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        D = cfg.hidden_size
        self.fc = linear(
            tp.split(len(cfg.target_layer_ids) * D, "drafter fc inputs (target layers x hidden)"), D, dtype
        )
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(DrafterLayer(cfg, dtype, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.rope = NeoxRope(cfg)

    def fuse_(self) -> None:
        """For inference (the loader, on CUDA), as `KimiK2.fuse_dense_` does for the target: q / k / v and
        gate / up stacked (one GEMM each), each residual add with the norm after it as one op
        (`RMSNorm.use_kernel`)."""
        for layer in self.layers:
            layer.self_attn.fuse_()
            layer.mlp.fuse_()
        for norm in self.residual_norms():
            norm.use_kernel = True

    def use_linear_kernel_(self) -> int:
        """Its projections (each stack of `fuse_` one launch) in the small-M kernel up to
        layers.KERNEL_MAX_ROWS rows (a draft block of one or two sequences, an accepted path's context rows);
        more (a batch's drafts, a prompt's context K/V) stay on cuBLAS. The loader turns it on after `fuse_`
        (CUDA, bf16): a draft 0.60 -> 0.56 ms on an H200, SiLU·up fused included
        (2026-12-07-drafter-kernel-swiglu-session45-h200.md; A/B: `bench_k26 --fused --drafter-cublas`)."""
        return use_linear_kernel(self, max_rows=KERNEL_MAX_ROWS)

    def residual_norms(self) -> list[RMSNorm]:
        """The norms that follow a residual add (`DrafterLayer.fused`): each layer's post-attention norm,
        the input norms of layers 1.. (layer 0's normalises the embedding: no add), the final norm."""
        after_attention = [layer.post_attention_layernorm for layer in self.layers]
        return after_attention + [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]

    def context_kv(self, feat_BCX: torch.Tensor, pos_BC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's (k, v) [layers, B, C, Hkv, hd] of context rows (`feat`: the target features, whole on
        every rank): fc (this rank's input slice, all-reduced) + hidden_norm once, then each layer's K/V."""
        part = self.fc.in_features
        ctx = self.hidden_norm(
            self.tp.reduce(self.fc(feat_BCX[..., self.tp.rank * part : (self.tp.rank + 1) * part]))
        )
        kv = [layer.self_attn.kv(ctx, pos_BC, self.rope) for layer in self.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def append_context(
        self, cache_k, cache_v, feat_BCX, pos_BC, rows_B, valid_BC=None, context_kv=None
    ) -> None:
        """Write context rows at their positions of the drafter cache [layers, rows, T, Hkv, hd] (one
        scatter for all layers). Rows with valid False (padding) go to the cache's last row, a trash row no
        sequence owns, so the write has a static shape (no boolean indexing, no host sync). `context_kv`:
        `self.context_kv` or a compiled copy (`CompiledDrafter`; the writes stay outside it: compiled, a
        write into the cache came with a copy of it, ~0.2 ms at 32K)."""
        r = rows_B[:, None].expand_as(pos_BC)
        p = pos_BC.clamp_max(cache_k.shape[2] - 1)
        if valid_BC is not None:
            r = torch.where(valid_BC, r, cache_k.shape[1] - 1)
        k, v = (context_kv or self.context_kv)(feat_BCX, pos_BC)
        cache_k[:, r, p] = k.to(cache_k.dtype)
        cache_v[:, r, p] = v.to(cache_v.dtype)

    def forward(
        self, x_BSD, pos_BS, cache_k, cache_v, rows_B, ctx_lens_B, static: bool = False
    ) -> torch.Tensor:
        """Block hidden states after the final norm [B, S, D]; context = cache positions < ctx_lens.
        `static`: whole cache rows, no host sync (graph bodies), as `AttnBatch.static`."""
        keys = live_keys(ctx_lens_B, 0, cache_k.shape[2], static)  # a view of the live slots, read in place
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        normed = self.layers[0].input_layernorm(x_BSD) if len(self.layers) else self.norm(x_BSD)
        for i, layer in enumerate(self.layers):
            ck, cv = cache_k[i][:, :keys], cache_v[i][:, :keys]
            attend = functools.partial(
                layer.self_attn.cached,
                pos_BS=pos_BS,
                cache_k=ck,
                cache_v=cv,
                rows_B=rows_B,
                ctx_lens_B=ctx_lens_B,
                rope=self.rope,
                partial=True,
            )
            normed, x_BSD = layer.fused(x_BSD, normed, attend, norms[i])
        return normed


class CompiledDrafter:
    """`drafter` with its block forward (every layer and the final norm) and its context K/V (fc, hidden
    norm, each layer's K/V; `append_context`'s cache writes stay eager) under torch.compile (fullgraph,
    static shapes), called as the drafter is; every other attribute (`cfg`, ...) is the drafter's own. For
    graph bodies (`static=True`): a forward over a live-length cache view would compile once per length.
    Eager, the forward is ~80 small kernels a layer (fp32 norms, RoPE, casts) and the context K/V ~20."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.compiled = compile_static(drafter.forward)
        self.append_context = functools.partial(
            drafter.append_context, context_kv=compile_static(drafter.context_kv)
        )

    def __call__(self, *args, **kw) -> torch.Tensor:
        return self.compiled(*args, **kw)

    def __getattr__(self, name: str):  # only for names this object lacks: the drafter's
        if name in ("drafter", "compiled", "append_context"):  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.drafter, name)


def drafter_logits(hidden_BSD: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    """fp32 log-probabilities of depths 1..B-1 (rows 1.. of the block) through the target's head."""
    return F.log_softmax(lm_head(hidden_BSD[:, 1:]).float(), dim=-1)
