"""The fused MoE op grouping a few tokens' pairs from the ids itself (moe_cuda.groups_from_ids: the gate/up
GEMM's group_from_ids and the down + combine's own table, csrc/moe_gemm.cuh / moe_down_combine.cuh) against
the table-driven paths, bit for bit, and the model's router writing no table where it does."""

import pytest
import torch
from oracles import poison_allocator
from test_moe_gpu import _kernel_names, assert_out_of_range_ids_contribute_nothing, block_inputs

from k26.ops import moe_cuda
from k26.ops.moe_cuda import pick_nt, repacked_reference, route_table

pytestmark = pytest.mark.gpu

E, K, D, INTER = 384, 8, 7168, 256  # K2.6 at one TP8 rank


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """The kernels' whole range (the default policy takes the path for the fewest pairs only)."""
    monkeypatch.setattr(moe_cuda, "GROUPS_FROM_IDS_MAX_PAIRS", 512)


def run(x, w, ids, tw, sh, table=None, from_ids=True, monkeypatch=None):
    monkeypatch.setattr(moe_cuda, "GROUPS_FROM_IDS", from_ids)
    poison_allocator()
    return torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh, table)


# M = 9 / 16 with "same": every expert 9 / 16 times (two groups of it: occurrences 0-7 and 8-); hot10:
# ten experts in many groups; 64 tokens: 512 pairs, the most group_from_ids takes.
@pytest.mark.parametrize("M", [2, 5, 9, 16, 33, 64])
@pytest.mark.parametrize("kind", ["uniform", "hot10", "same"])
@pytest.mark.parametrize("with_shared", [False, True])
def test_groups_from_the_ids_give_the_table_paths_bits(M, kind, with_shared, monkeypatch):
    _, w, sh, x, ids, tw = block_inputs(900 + M, M, E, K, D, INTER, kind, with_shared=with_shared)
    assert moe_cuda.groups_from_ids(M, K, E, D, INTER, with_shared)
    own = run(x, w, ids, tw, sh, monkeypatch=monkeypatch)
    routed = run(x, w, ids, tw, sh, from_ids=False, monkeypatch=monkeypatch)  # the op's routing launch
    table = route_table(ids, E, pick_nt(M * K, E), with_shared)
    given = run(x, w, ids, tw, sh, table=table, monkeypatch=monkeypatch)  # a table passed in
    assert torch.isfinite(own.float()).all()
    assert torch.equal(own, routed) and torch.equal(own, given)
    ref = repacked_reference(x, *w, ids, tw, *sh).float()
    assert ((own.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_groups_from_the_ids_launch_no_routing_kernel(monkeypatch):
    _, w, sh, x, ids, tw = block_inputs(950, 16, E, K, D, INTER)
    own = _kernel_names(lambda: torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh))
    monkeypatch.setattr(moe_cuda, "GROUPS_FROM_IDS", False)
    routed = _kernel_names(lambda: torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh))
    assert not any("route_kernel" in k for k in own), own
    assert any("route_kernel" in k for k in routed), routed
    assert any("down_combine_grouped" in k for k in own), own


def test_model_router_writes_no_table_where_the_op_groups_from_ids(tiny_k25, monkeypatch):
    """The tiny K2.5 pair's MoE layer on 30 tokens (16 experts, top-4: < 8 pairs an expert, one column tile a
    group): no table from the router (the op groups the pairs), the same bits as with the router's table
    (GROUPS_FROM_IDS off)."""
    from k26 import LLM

    llm = LLM(tiny_k25, device="cuda", progress=False)
    moe = llm.model.layers[1].mlp
    gen = torch.Generator("cuda").manual_seed(9)
    x = torch.randn(3, 10, moe.gate.weight.shape[1], generator=gen, device="cuda").to(torch.bfloat16)
    x_TD = x.flatten(0, 1)
    fused = moe.experts.fuses(moe.shared_experts, x_TD)
    with torch.no_grad():
        assert moe.gate.route(x_TD, shared=fused, table=moe._wants_table(x_TD, fused))[2] is None
        own_kernels = _kernel_names(lambda: moe(x, partial=True))
        own = moe(x, partial=True)
        monkeypatch.setattr(moe_cuda, "GROUPS_FROM_IDS", False)
        assert moe.gate.route(x_TD, shared=fused, table=moe._wants_table(x_TD, fused))[2] is not None
        with_table = moe(x, partial=True)
    assert not any("route_kernel" in k for k in own_kernels), own_kernels
    assert any("down_combine_grouped" in k for k in own_kernels), own_kernels
    assert torch.isfinite(own.float()).all() and torch.equal(own, with_table)


# Inside a graph the ids are not checked: pairs with an id outside [0, E) add nothing and read nothing out of
# bounds on this path too (two tokens: the default's range; 5 and 64 under the raised limit).
@pytest.mark.parametrize("M, E", [(2, 64), (5, 64), (64, 384)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_out_of_range_ids_inside_capture_contribute_nothing_from_the_ids(M, E, with_shared):
    K, D, inter = 8, 512, 256
    gen, w, sh, x, ids, tw = block_inputs(980 + M, M, E, K, D, inter, with_shared=with_shared)
    assert moe_cuda.groups_from_ids(M, K, E, D, inter, with_shared)
    assert_out_of_range_ids_contribute_nothing(gen, w, sh, x, ids, tw, E)
