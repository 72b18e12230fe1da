"""`moe_w4a16_repacked` with the shared expert (CPU): its reference is the routed experts of the checkpoint
layout plus the shared expert's MLP, added after the routed sum is rounded, as MoE.forward did separately."""

import torch
from oracles import random_int4_experts

import k26.ops  # noqa: F401  (registers the ops)
from k26.ops import reference
from k26.ops.moe_layout import repack_experts


def inputs(T=6, E=4, D=64, inter=64, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)

    ct = random_int4_experts(E, D, inter, g)
    shared = tuple(
        (torch.randn(*s, generator=g) * 0.1).to(torch.bfloat16) for s in ((inter, D), (inter, D), (D, inter))
    )
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ct, shared, ids, torch.rand(T, K, generator=g)


def test_shared_expert_adds_after_the_routed_sum():
    x, ct, shared, ids, w = inputs()
    got = torch.ops.k26.moe_w4a16_repacked(x, *repack_experts(*ct), ids, w, *shared)
    routed = reference.moe_w4a16(x, *ct, ids, w)  # bf16, as the experts module returned it
    assert torch.equal(got, routed + reference.expert_mlp(x, *shared))


def test_repacked_op_with_shared_expert_opcheck():
    x, ct, shared, ids, w = inputs(T=3)
    args = (x, *repack_experts(*ct), ids, w, *shared)
    torch.library.opcheck(
        torch.ops.k26.moe_w4a16_repacked.default, args, test_utils=("test_schema", "test_faketensor")
    )
