"""Random K2.6-scale models and inputs for the step benchmarks (profiling/bench_k26.py): the target's and the
DFlash drafter's published configs, weights drawn in the loaded layouts (bf16 + repacked int4 experts),
seeded verify tokens and (`--seeded-tree`) a seeded draft top-k."""

from __future__ import annotations

import math

import torch

from k26.config import K26_TEXT_CONFIG
from k26.drafter_config import DrafterConfig
from k26.model.moe import Int4Experts
from k26.ops.moe_layout import repack_scales, w13_row_order
from k26.tiny import quantization_config

K26_TEXT = K26_TEXT_CONFIG | {"quantization_config": quantization_config()}


def drafter_config() -> DrafterConfig:
    """Kimi-K2.5-DFlash (the module splits it per TP rank: 64/tp query heads, 8/tp KV heads, 18432/tp MLP
    columns, fc's inputs)."""
    raw = {
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 6,
        "intermediate_size": 18432,
        "rms_norm_eps": 1e-6,
        "vocab_size": 163840,
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "rope_scaling": K26_TEXT["rope_scaling"],
        "block_size": 8,
        "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838},
    }
    return DrafterConfig.from_dict(raw)


@torch.no_grad()
def token_ids(N: int, vocab: int, dev: torch.device) -> torch.Tensor:
    """The verified tokens [1, N], the same in every run (seeded by N): their routing decides the experts a
    step reads, so unseeded draws made two runs of one commit touch 11 to 32 experts per layer at N = 16."""
    gen = torch.Generator(device=dev).manual_seed(N)
    return torch.randint(0, vocab, (1, N), device=dev, generator=gen)


def seed_draft_topk(vocab: int, dev: torch.device) -> None:
    """`--seeded-tree`: the step's draft top-k, after the drafter has run (its kernels stay in the step), is
    replaced by the same seeded (log-prob, token) table in every run, so every run builds and verifies the
    same tree: with random weights the drafter's own tokens set the experts the verify reads, and a change
    that only rounds the drafter differently moved a DFlash step by 6 % (2026-12-02, call 7)."""
    import k26.spec.step as step_mod

    real = step_mod.draft_topk
    gen = torch.Generator(device=dev).manual_seed(1234)
    tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def seeded(*args, **kw):
        lp, tok = real(*args, **kw)
        if lp.shape not in tables:  # made outside capture: the warm-ups run every shape first
            fixed = torch.rand(lp.shape, device=dev, generator=gen).log().sort(-1, descending=True).values
            base = torch.randint(0, vocab, (*tok.shape[:-1], 1), device=dev, generator=gen)
            ranks = torch.arange(tok.shape[-1], device=dev)
            tables[lp.shape] = fixed, (base + ranks) % vocab  # distinct tokens per depth, as a top-k's
        return tables[lp.shape]

    step_mod.draft_topk = seeded


def randomize(model: torch.nn.Module, skew: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, p in model.named_parameters():
        if p.dtype == torch.int32:
            p.random_(generator=g)
        elif name.endswith("e_score_correction_bias"):
            # a correction bias like a trained router's; "skew" makes a few experts popular
            p.normal_(0, 0.5 if skew else 0.02, generator=g)
        elif "norm" in name:
            p.fill_(1.0)
        elif name.endswith("_scale"):
            p.uniform_(0.002, 0.01, generator=g)
        else:
            p.normal_(0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
    for m in model.modules():
        if isinstance(
            m, Int4Experts
        ):  # random words are random in any layout: draw the kernel layout directly
            E, inter, D = m.gate_packed.shape[0], m.gate_packed.shape[1], m.gate_packed.shape[2] * 8
            # seeded like everything else: unseeded words changed every later layer's input, hence the
            # experts touched at N = 16 (18 vs 25 per layer between two runs of one commit)
            shape13, shape2 = (E, inter // 8, D // 64, 32, 4), (E, D // 16, inter // 64, 32, 4)
            w13 = torch.randint(-(2**31), 2**31 - 1, shape13, dtype=torch.int32, device="cuda", generator=g)
            w2 = torch.randint(-(2**31), 2**31 - 1, shape2, dtype=torch.int32, device="cuda", generator=g)
            s13 = repack_scales(torch.cat([m.gate_scale, m.up_scale], 1), w13_row_order(inter))
            s2 = repack_scales(m.down_scale)
            for n in ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale"):
                delattr(m, n)
            m.w13, m.s13, m.w2, m.s2 = (
                torch.nn.Parameter(t, requires_grad=False) for t in (w13, s13, w2, s2)
            )
            m.repacked = True
