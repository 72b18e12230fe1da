"""The load-time repack for the CUDA MoE kernel is lossless, and its reference equals the original op."""

import pytest
import torch

from k26.ops import pack_int4
from k26.ops.moe_cuda import check_inputs, repack, repack_experts, unrepack, w13_row_order


def experts(E=3, D=128, inter=64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def packed(o, i):
        return pack_int4(torch.randint(-8, 8, (E, o, i), generator=g, dtype=torch.int8))

    def scale(o, i):
        return (torch.rand(E, o, i // 32, generator=g) * 0.1 + 0.01).to(torch.bfloat16)

    return (
        packed(inter, D),
        scale(inter, D),
        packed(inter, D),
        scale(inter, D),
        packed(D, inter),
        scale(D, inter),
    )


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
