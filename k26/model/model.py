"""The K2 / K2.5 / K2.6 text model: embedding, 1 dense + N MoE decoder layers of MLA, final norm, head.

`forward` takes token ids with an `AttnBatch` (causal chunk or tree) and the latent cache, and can
hand back the residual stream after chosen layers for the DFlash drafter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import nn

from ..compiling import compile_static
from ..config import ModelConfig
from ..ops import reference
from .batch import AttnBatch
from .layers import KERNEL_MAX_ROWS, MLP, RMSNorm, TPInfo, VocabEmbedding, VocabHead, use_linear_kernel
from .mla import MLA
from .moe import MoE
from .rope import Rope


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, tp: TPInfo):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLA(cfg, dtype, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.is_moe_layer(index):
            self.mlp: nn.Module = MoE(cfg, dtype, tp)
            self.dense = False
        else:
            self.mlp = MLP(cfg.hidden_size, tp.split(cfg.intermediate_size, "intermediate_size"), dtype)
            self.dense = True

    def forward(self, x, normed, batch: AttnBatch, cache_RLC, rope: Rope, absorb: bool, next_norm: RMSNorm):
        """The residual stream `x` and its input norm `normed` (from the layer before) -> (next_norm(x'), x').
        Each all-reduce runs with the residual add and the norm after it (`TPInfo.reduce_add_norm`:
        one fused kernel over peer memory when the TP group has it, else all-reduce, add, norm)."""
        a = self.self_attn(normed, batch, cache_RLC, rope, absorb, partial=True)
        normed, x = self.tp.reduce_add_norm(a, x, self.post_attention_layernorm)
        h = self.mlp(normed) if self.dense else self.mlp(normed, partial=True)
        return self.tp.reduce_add_norm(h, x, next_norm)


class KimiK2(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, tp: TPInfo = TPInfo()):
        super().__init__()
        cfg.check_tp(tp.size)
        self.cfg, self.dtype, self.tp = cfg, dtype, tp
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = VocabHead(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.rope = Rope(cfg.rope, cfg.qk_rope_head_dim)

    def forward(
        self,
        ids_BN: torch.Tensor,
        batch: AttnBatch,
        cache_LRTC: torch.Tensor | None,
        *,
        aux_layers: tuple[int, ...] = (),
        absorb: bool = True,
        layers: Sequence[Callable] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the final-normed hidden states [B, N, D] and, if asked, the outputs of `aux_layers`
        concatenated on the last dim [B, N, len(aux_layers)·D] (the DFlash context features). With
        `cache_LRTC` None (training) the tokens attend only among themselves. `layers`: callables that
        stand for `self.layers` (their compiled forms, `CompiledLayers`)."""
        x = self.embed_tokens(ids_BN)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        normed = self.layers[0].input_layernorm(x) if len(self.layers) else self.norm(x)
        aux = []
        # The batch's cache spans checked once for every layer's cache ops (each a device sync on CUDA).
        spans = nullcontext()
        if cache_LRTC is not None and len(self.layers):
            args = (cache_LRTC[0], batch.rows_B, batch.prefix_lens_B, batch.num_new)
            spans = reference.spans_checked("KimiK2.forward", *args)
        with spans:
            for i, layer in enumerate(self.layers if layers is None else layers):
                cache = None if cache_LRTC is None else cache_LRTC[i]
                normed, x = layer(x, normed, batch, cache, self.rope, absorb, norms[i])
                if i in aux_layers:
                    aux.append(x)
        return normed, (torch.cat(aux, dim=-1) if aux_layers else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def fuse_dense_(self) -> None:
        """After loading, for inference: each MLA's q_a / kv_a stacked into one matrix and its projections
        in the small-M linear kernel at the row counts where that measured faster (`MLA.fuse_`); the dense
        layers' MLP (K2.6: layer 0) with gate / up stacked and, up to layers.KERNEL_MAX_ROWS rows, in the
        small-M kernel (gate / up with SiLU·up one launch, `linear_swiglu`, then down); each residual add
        with the norm after it as one op (`RMSNorm.use_kernel`)."""
        for layer in self.layers:
            layer.self_attn.fuse_()
        self.fuse_mlp_()
        for norm in self.residual_norms():
            norm.use_kernel = True

    def fuse_mlp_(self, kernel: bool = True) -> None:
        """The dense layers' MLP: gate / up stacked (for good) and, with `kernel`, in the small-M kernel up to
        layers.KERNEL_MAX_ROWS rows (more: cuBLAS); kernel False puts it back on cuBLAS (an A/B side)."""
        for layer in self.layers:
            if layer.dense:
                layer.mlp.fuse_()
                use_linear_kernel(layer.mlp, kernel, max_rows=KERNEL_MAX_ROWS)

    def residual_norms(self) -> list[RMSNorm]:
        """The norms that follow a residual add (`TPInfo.reduce_add_norm`): each layer's post-attention
        norm, the input norms of layers 1.. (layer 0's normalises the embedding: no add), the final norm."""
        after_attention = [layer.post_attention_layernorm for layer in self.layers]
        return after_attention + [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]

    def forward_train(self, ids_BT: torch.Tensor, aux_layers: tuple[int, ...] = ()):
        """Differentiable causal forward over whole sequences: `forward` with no cache (each layer's attention
        then runs over the sequence itself); final hidden states and, if asked, the `aux_layers` outputs."""
        B, T = ids_BT.shape
        batch = AttnBatch.causal(torch.zeros(B, dtype=torch.long, device=ids_BT.device), T)
        return self.forward(ids_BT, batch, None, aux_layers=aux_layers)


class CompiledLayers:
    """`model` with each decoder layer under torch.compile (fullgraph, static shapes), called as the model
    is; every other attribute (`lm_head`, `logits`, `cfg`, ...) is the model's own. The rest of the forward
    stays eager (embedding, first norm, the loop: inside a CUDA graph their kernels are captured all the
    same). Layers of one kind share one compiled body, so a graph bucket compiles one dense and one MoE
    layer, not the whole depth (CPU, 48 layers: 33 s as one body, ~4 s this way; profiling/results,
    bench_compile). Each (layer kind, bucket shape) is one compiled version (`compile_static`)."""

    def __init__(self, model: KimiK2):
        self.model = model
        self.compiled = [compile_static(layer) for layer in model.layers]

    def __call__(self, *args, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(*args, layers=self.compiled, **kw)

    def __getattr__(self, name: str):  # only for names this object lacks: the model's
        if name in ("model", "compiled"):  # not set yet (a copy being built): no recursion through them
            raise AttributeError(name)
        return getattr(self.model, name)
