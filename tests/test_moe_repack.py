"""The load-time repack for the CUDA MoE kernel is lossless, and its reference equals the original op."""

import pytest
import torch
from oracles import random_int4_experts

from k26.ops import pack_int4
from k26.ops.moe_cuda import check_inputs, route_table, route_table_size
from k26.ops.moe_layout import repack, repack_experts, unrepack, w13_row_order


def experts(E=3, D=128, inter=64, seed=0):
    return random_int4_experts(E, D, inter, torch.Generator().manual_seed(seed))


def test_repack_round_trip():
    p, s = experts()[4:6]
    q, s2 = unrepack(*repack(p, s))
    assert torch.equal(pack_int4(q), p) and torch.equal(s2, s)


def test_w13_interleaves_gate_and_up():
    order = w13_row_order(64)
    assert order[:16].tolist() == list(range(8)) + list(range(64, 72))
    assert sorted(order.tolist()) == list(range(128))


def test_repacked_reference_equals_original_op():
    ex = experts(E=4, D=128, inter=128, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g)
    ref = torch.ops.k26.moe_w4a16(x, *ex, ids, w)
    got = torch.ops.k26.moe_w4a16_repacked(x, *repack_experts(*ex), ids, w)
    assert torch.equal(got, ref)


def test_repacked_opcheck():
    ex = repack_experts(*experts())
    x = torch.randn(3, 128).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 1], [2, 0], [1, 2]]), torch.rand(3, 2)
    torch.library.opcheck(
        torch.ops.k26.moe_w4a16_repacked.default,
        (x, *ex, ids, w),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda a: a.__setitem__(0, a[0].float()), "x must be 2-D bf16"),
        (lambda a: a.__setitem__(0, a[0][:, :64]), "w13 holds D=128 but x has D=64"),
        (lambda a: a.__setitem__(2, a[2][:2]), "s13 must be bf16"),
        (lambda a: a.__setitem__(6, a[6][:, :1]), "topk_weights must be float"),
        (lambda a: a.__setitem__(6, a[6].t().contiguous().t()), "topk_weights must be contiguous"),
    ],
)
def test_front_door_names_bad_inputs(mutate, needle):
    args = [
        torch.randn(3, 128).to(torch.bfloat16),
        *repack_experts(*experts()),
        torch.tensor([[0, 1], [2, 0], [1, 2]]),
        torch.rand(3, 2),
    ]
    mutate(args)
    with pytest.raises(ValueError, match=needle):
        check_inputs(*args)


def split_table(table, slots):
    """A routing table's (experts, starts, lens of its groups in use, slots) as lists; `slots` = P + S."""
    t = table.long()
    n, G = int(t[0]), (t.numel() - 1 - slots) // 3
    rows = t[1 + slots :].view(3, G)[:, :n].tolist()
    return rows[0], rows[1], rows[2], t[1 : 1 + slots].tolist()


def test_reference_table_groups_every_pair_once():
    ids = torch.tensor([[3, 1], [1, 0], [1, 3], [9, 1], [-1, 1]])  # 9 and -1: out of range, in no group
    P, S, E = ids.numel(), ids.shape[0], 4
    for nt in (1, 2):
        table = route_table(ids, E, nt, shared=True)
        assert table.numel() == route_table_size(S, 2, E, nt, True)
        experts, starts, lens, slots = split_table(table, P + S)
        routed = experts[experts.count(E) :]  # the shared expert's groups first, then by expert
        assert experts[0] == E and routed == sorted(routed) and E not in routed and max(lens) <= 8 * nt
        seen = [p for s0, ln in zip(starts, lens, strict=True) for p in slots[s0 : s0 + ln]]
        assert sorted(seen) == [p for p in range(P) if 0 <= ids.flatten()[p] < E] + list(range(P, P + S))
        for e, s0, ln in zip(experts, starts, lens, strict=True):
            assert all(p >= P or ids.flatten()[p] == e for p in slots[s0 : s0 + ln])


def test_a_table_of_another_size_is_named():
    args = [
        torch.randn(3, 128).to(torch.bfloat16),
        *repack_experts(*experts()),
        torch.tensor([[0, 1], [2, 0], [1, 2]]),
        torch.rand(3, 2),
    ]
    with pytest.raises(ValueError, match="table must be int32"):
        check_inputs(*args, table=torch.zeros(5, dtype=torch.int32))
    ok = route_table(args[5], 3, 1, False)
    assert check_inputs(*args, table=ok)[0] == 3


@pytest.mark.parametrize("bad", [3, -1])
def test_the_reference_path_refuses_an_expert_id_outside_the_experts(bad):
    """On the CPU an id of E was an IndexError from the reference's indexing and -1 silently took the last
    expert; the CUDA path names it (outside a capture): so does the reference now."""
    ex = repack_experts(*experts())
    x = torch.randn(3, 128).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 1], [2, bad], [1, 2]]), torch.rand(3, 2)
    with pytest.raises(ValueError, match=f"topk_ids holds {bad}, outside \\[0, 3\\)"):
        torch.ops.k26.moe_w4a16_repacked(x, *ex, ids, w)


@pytest.mark.parametrize("E, ok", [(4000, True), (4053, False)])
def test_the_expert_count_limit_is_what_the_routing_launch_can_take(E, ok):
    """The routing kernel's 3 ints an expert of shared memory (no opt-in) beside its static bytes fit 48 KB
    up to 4,052 experts: 4,053-4,096 passed the check and failed at launch."""
    D, I = 64, 64
    x = torch.zeros(1, D, dtype=torch.bfloat16, device="meta")
    w13 = torch.zeros(E, I // 8, D // 64, 32, 4, dtype=torch.int32, device="meta")
    s13 = torch.zeros(E, I // 8, D // 64, 16, 2, dtype=torch.bfloat16, device="meta")
    w2 = torch.zeros(E, D // 16, I // 64, 32, 4, dtype=torch.int32, device="meta")
    s2 = torch.zeros(E, D // 16, I // 64, 16, 2, dtype=torch.bfloat16, device="meta")
    ids, w = torch.zeros(1, 2, dtype=torch.long, device="meta"), torch.zeros(1, 2, device="meta")
    if ok:
        assert check_inputs(x, w13, s13, w2, s2, ids, w)[3] == E
    else:
        with pytest.raises(ValueError, match="E=4053 experts exceeds the routing kernel's 4000"):
            check_inputs(x, w13, s13, w2, s2, ids, w)
