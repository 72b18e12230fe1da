"""K2 mixture of experts: sigmoid router with a selection-only correction bias, group-limited top-k,
routed experts (int4 pack-quantized or bf16) split along the intermediate dim, and a shared expert."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops import moe_block_cuda, moe_cuda, reference
from ..ops.moe_layout import repack_experts
from ..ops.router_cuda import router_barrier
from .layers import MLP, TPInfo

# Above this many (token, expert) pairs the expert op routes in its own launch: the router kernel's last block
# (256 threads) holds two ids a thread up to here, and a prefill's table is a small part of its MoE layer.
TABLE_MAX_PAIRS = 512


class Router(nn.Module):
    """noaux_tc gate: the bias chooses experts, the unbiased sigmoid scores weight them
    (`reference.moe_router` is the specification; after `fuse_()` one CUDA kernel computes it)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        self.register_buffer("barrier", None, persistent=False)  # the fused kernel's grid-barrier scratch
        # With the fused kernel, also build the expert op's routing table for more than one token (the
        # expert op then runs no routing launch); False: the expert op routes itself (the A/B in benchmarks).
        self.writes_table = False
        # With the fused kernel, one token's whole block in two launches (`moe_one_token`: the router kernel
        # runs the gate/up GEMMs too) instead of router + expert op (three launches). Off: measured slower
        # (H100, 2026-12-05: the MoE block 25.2 -> 25.8 µs, the 61-layer decode step 4.48 -> 4.76 ms;
        # profiling/results/2026-12-05-moe-two-launch-session25-h100.md).
        self.one_token_block = False

    @torch.no_grad()
    def fuse_(self) -> None:
        """Route with the fused CUDA kernel (csrc/moe_router.cu) from now on: bf16 weight on CUDA, loaded."""
        self.barrier = router_barrier(self.weight.device)
        self.writes_table = True

    def params(self) -> tuple:
        """The routing parameters the router ops take after the tensors: n_group, topk_group, topk,
        renormalize, scale."""
        cfg = self.cfg
        return (
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.barrier is not None and x_TD.dtype == torch.bfloat16:
            return torch.ops.k26.moe_router(
                x_TD.contiguous(), self.weight, self.e_score_correction_bias, self.barrier, *self.params()
            )
        return reference.moe_router(x_TD, self.weight, self.e_score_correction_bias, *self.params())

    def serves_block(self, x_TD: torch.Tensor) -> bool:
        """Whether `MoE.forward` runs this batch's block as `moe_one_token` (with the fused kernel)."""
        cfg = self.cfg
        return (
            self.one_token_block
            and self.barrier is not None
            and x_TD.dtype == torch.bfloat16
            and moe_block_cuda.serves(x_TD.shape[0], cfg.hidden_size, cfg.num_experts_per_tok)
        )

    def route(
        self, x_TD: torch.Tensor, shared: bool, table: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(weights, ids, routing table or None): the table of `moe_w4a16_repacked` (with the shared expert's
        slots when `shared`) from the fused kernel when it writes one and the expert op wants one (`table`),
        for more than one token (one token routes straight from its ids in the expert op) and at most
        TABLE_MAX_PAIRS pairs."""
        M, fused = x_TD.shape[0], self.barrier is not None and x_TD.dtype == torch.bfloat16
        pairs = M * self.cfg.num_experts_per_tok
        if not (table and self.writes_table and fused and M > 1 and pairs <= TABLE_MAX_PAIRS):
            return (*self(x_TD), None)
        args = (x_TD.contiguous(), self.weight, self.e_score_correction_bias, self.barrier, *self.params())
        return torch.ops.k26.moe_router_table(*args, shared)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Int4Experts(nn.Module):
    """Experts stacked over E in the compressed-tensors layout: packed int32 along the input dim.
    Scales stay bf16 whatever the activation dtype: the checkpoint's weights are bf16(q·s)."""

    CHECKPOINT = ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale")

    def __init__(self, E: int, D: int, inter: int, group: int):
        super().__init__()
        dtype = torch.bfloat16
        self.gate_packed = _param(E, inter, D // 8, dtype=torch.int32)
        self.gate_scale = _param(E, inter, D // group, dtype=dtype)
        self.up_packed = _param(E, inter, D // 8, dtype=torch.int32)
        self.up_scale = _param(E, inter, D // group, dtype=dtype)
        self.down_packed = _param(E, D, inter // 8, dtype=torch.int32)
        self.down_scale = _param(E, D, inter // group, dtype=dtype)

        self.repacked = False

    def checkpoint_tensors(self) -> tuple[torch.Tensor, ...]:
        """The int4 weights in the checkpoint's layout, in `CHECKPOINT` order (before `repack_`)."""
        return tuple(getattr(self, name) for name in self.CHECKPOINT)

    @torch.no_grad()
    def repack_(self) -> None:
        """Swap the checkpoint layout for the CUDA kernel's (csrc/moe_w4a16.cu), once, after loading."""
        w13, s13, w2, s2 = repack_experts(*self.checkpoint_tensors())
        for name in self.CHECKPOINT:
            delattr(self, name)
        self.w13, self.s13, self.w2, self.s2 = (
            nn.Parameter(t, requires_grad=False) for t in (w13, s13, w2, s2)
        )
        self.repacked = True

    def quantised(self) -> tuple[torch.Tensor, ...]:
        """The repacked weights and scales the CUDA kernels take: w13, s13, w2, s2."""
        return self.w13, self.s13, self.w2, self.s2

    def fuses(self, shared: MLP | None, x_TD: torch.Tensor) -> bool:
        """Whether the kernel can run `shared` as one more expert in its grids (bf16, routed width)."""
        return (
            self.repacked
            and shared is not None
            and x_TD.dtype == torch.bfloat16
            and tuple(shared.gate_proj.weight.shape) == (self.w13.shape[1] * 8, self.w13.shape[2] * 64)
        )

    def forward(self, x_TD, ids_TK, w_TK, shared: MLP | None = None, table: torch.Tensor | None = None):
        """Routed experts; with `shared` (only when `fuses`) plus the shared expert, in the same launches.
        `table`: the routing table of these ids (`Router.route`, repacked only)."""
        if self.repacked:
            sw = shared_weights(shared)
            return torch.ops.k26.moe_w4a16_repacked(x_TD, *self.quantised(), ids_TK, w_TK, *sw, table)
        return torch.ops.k26.moe_w4a16(x_TD, *self.checkpoint_tensors(), ids_TK, w_TK)


class DenseExperts(nn.Module):
    """Unquantised experts (bf16 checkpoints), stacked over E."""

    def __init__(self, E: int, D: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = _param(E, inter, D, dtype=dtype)
        self.up_proj = _param(E, inter, D, dtype=dtype)
        self.down_proj = _param(E, D, inter, dtype=dtype)

    def forward(self, x_TD, ids_TK, w_TK):
        return reference.moe_combine(
            x_TD, ids_TK, w_TK, lambda e: (self.gate_proj[e], self.up_proj[e], self.down_proj[e])
        )


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TPInfo):
        super().__init__()
        self.tp = tp
        inter = tp.split(cfg.moe_intermediate_size, "moe_intermediate_size")
        E, D = cfg.n_routed_experts, cfg.hidden_size
        self.inter = inter  # this rank's expert width
        self.gate = Router(cfg, dtype)
        if cfg.quant.int4:
            self.experts: nn.Module = Int4Experts(E, D, inter, cfg.quant.group_size)
        else:
            self.experts = DenseExperts(E, D, inter, dtype)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = MLP(D, tp.split(shared, "shared expert width"), dtype) if shared else None

    def forward(self, x_BND: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """`partial`: this rank's share, unreduced (the caller reduces it with the residual add and the next
        norm, `TPInfo.reduce_add_norm`)."""
        x_TD = x_BND.flatten(0, -2)
        if isinstance(self.experts, Int4Experts) and self.experts.repacked:
            fused = self.experts.fuses(self.shared_experts, x_TD)
            if self.gate.serves_block(x_TD) and (fused or self.shared_experts is None):
                y_TD = self._one_token(x_TD)
                return y_TD.view_as(x_BND) if partial else self.tp.reduce(y_TD.view_as(x_BND))
            w_TK, ids_TK, table = self.gate.route(x_TD, shared=fused, table=self._wants_table(x_TD, fused))
            y_TD = self.experts(x_TD, ids_TK, w_TK, self.shared_experts if fused else None, table)
            if self.shared_experts is not None and not fused:
                y_TD = y_TD + self.shared_experts(x_TD)
        else:
            w_TK, ids_TK = self.gate(x_TD)
            y_TD = self.experts(x_TD, ids_TK, w_TK)
            if self.shared_experts is not None:
                y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view_as(x_BND) if partial else self.tp.reduce(y_TD.view_as(x_BND))

    def _wants_table(self, x_TD: torch.Tensor, fused: bool) -> bool:
        """No routing table where the expert op groups the pairs from the ids itself
        (moe_cuda.groups_from_ids): the router kernel's last block then builds none (~3.6 µs of its tail at
        16 tokens on an H100, profiling/debug/router_trace.py --table)."""
        cfg = self.gate.cfg
        M, K, E = x_TD.shape[0], cfg.num_experts_per_tok, cfg.n_routed_experts
        return not moe_cuda.groups_from_ids(M, K, E, cfg.hidden_size, self.inter, fused)

    def _one_token(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The block of one token in two launches (router + gate/up, down + combine): `moe_one_token`."""
        g, ex = self.gate, self.experts
        router = (g.weight, g.e_score_correction_bias, g.barrier, *g.params())
        sw = shared_weights(self.shared_experts)
        return torch.ops.k26.moe_one_token(x_TD.contiguous(), *router, *ex.quantised(), *sw)


def shared_weights(mlp: MLP | None) -> tuple[torch.Tensor | None, ...]:
    """The shared expert's gate, up and down weights as the fused MoE ops take them (None: none)."""
    if mlp is None:
        return (None, None, None)
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


def use_cuda_kernels(model: torch.nn.Module) -> None:
    """Repack int4 experts for the fused CUDA MoE kernel, layer by layer (one layer's copy at a time).
    The dense path is the loader's next step (`KimiK2.fuse_dense_`)."""
    from ..ops import build

    experts = [m for m in model.modules() if isinstance(m, Int4Experts)]
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not (experts or routers):
        return
    if not build.available():  # warns once; the int4 experts keep the reference layout
        return
    for m in experts:
        m.repack_()
    for r in routers:
        r.fuse_()  # one kernel from hidden state to top-k ids / weights (csrc/moe_router.cu)
