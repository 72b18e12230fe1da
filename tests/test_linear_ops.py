"""torch.ops.k26.linear / linear_grouped on CPU: the reference is the specification (fp32-accumulated
x @ W^T rounded once, then the residual), schema and fake agree (opcheck), bad inputs are named, and the
split-K plan covers K and fits the kernel's shared memory."""

import math

import pytest
import torch

import k26.ops  # noqa: F401  (registers the ops)
from k26.ops.linear_cuda import MAX_M, UNIT, padded_m, plan_splits


def rand(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_linear_is_fp32_accumulated_matmul_rounded_once():
    x, w = rand(3, 5, 136, seed=1), rand(40, 136, seed=2)
    want = (x.double() @ w.double().T).to(torch.bfloat16)
    got = torch.ops.k26.linear(x, w)
    assert got.shape == (3, 5, 40) and got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2**-8


def test_residual_is_added_after_rounding():
    x, w, r = rand(4, 64, seed=3), rand(24, 64, seed=4), rand(4, 24, seed=5)
    assert torch.equal(torch.ops.k26.linear(x, w, r), torch.ops.k26.linear(x, w) + r)


def test_grouped_is_one_linear_per_group():
    x, w = rand(2, 3, 4, 32, seed=6), rand(4, 16, 32, seed=7)
    got = torch.ops.k26.linear_grouped(x, w)
    for g in range(4):
        assert torch.equal(got[..., g, :], torch.ops.k26.linear(x[..., g, :].contiguous(), w[g]))


def test_linear_opcheck():
    args = (rand(7, 48, seed=8), rand(20, 48, seed=9), rand(7, 20, seed=10))
    torch.library.opcheck(torch.ops.k26.linear.default, args, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(
        torch.ops.k26.linear.default, args[:2], test_utils=("test_schema", "test_faketensor")
    )


def test_grouped_opcheck():
    args = (rand(5, 2, 64, seed=11), rand(2, 8, 64, seed=12))
    torch.library.opcheck(
        torch.ops.k26.linear_grouped.default, args, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize(
    "x,w,r,match",
    [
        ((3, 64), (16, 32), None, "x has K=64"),
        ((3, 64), (16, 64, 1), None, "weight must be \\[N, K\\]"),
        ((3, 64), (16, 64), (3, 15), "residual must be \\[3, 16\\]"),
    ],
)
def test_bad_shapes_are_named(x, w, r, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.k26.linear(rand(*x), rand(*w), rand(*r) if r else None)


def test_mixed_dtypes_are_named():
    with pytest.raises(ValueError, match="weight dtype torch.float32 differs"):
        torch.ops.k26.linear(rand(2, 8), rand(4, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match="residual dtype"):
        torch.ops.k26.linear(rand(2, 8), rand(4, 8), rand(2, 4, dtype=torch.float16))


def test_integer_input_is_refused():
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        torch.ops.k26.linear(torch.ones(2, 8, dtype=torch.int32), rand(4, 8))


def test_grouped_bad_shapes_are_named():
    with pytest.raises(ValueError, match="x ends in \\[3, 32\\] but weight is \\[G=4"):
        torch.ops.k26.linear_grouped(rand(2, 3, 32), rand(4, 8, 32))
    with pytest.raises(ValueError, match="weight must be \\[G, N, K\\]"):
        torch.ops.k26.linear_grouped(rand(2, 4, 32), rand(8, 32))


@pytest.mark.parametrize("M", [1, 7, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize(
    "N,K,G", [(2112, 7168, 1), (1536, 1536, 1), (128, 512, 8), (163840, 7168, 1), (40, 72, 1)]
)
def test_split_plan_covers_k_and_fits_shared_memory(M, N, K, G):
    S, per = plan_splits(M, N, K, G)
    units = math.ceil(K / UNIT)
    assert (S, per) == (0, units)  # tile mode: one block per 16 rows over all of K, nothing staged
    S, per = plan_splits(M, N, K, G, splits=1)  # split-K, when asked
    assert (S - 1) * per < units <= S * per  # every unit in exactly one split, no empty split
    assert (
        2 * padded_m(M) * (per * UNIT + 32) + 1024 <= 48 * 1024
    )  # room for the kernel's static shared memory


def test_padded_m_is_a_kernel_instance():
    assert [padded_m(m) for m in (1, 8, 9, 16, 17, 32, 33, MAX_M)] == [8, 8, 16, 16, 32, 32, 64, 64]


def test_swiglu_is_silu_of_the_gate_rows_times_the_up_rows():
    """The specification: linear_swiglu(x, [gate; up]) is the eager bf16 MLP product of the two halves —
    each projection rounded, F.silu's bf16 result, then the bf16 product (one rounding of silu(g) * u in
    fp32 would fail it); the kernel's epilogue follows these rounding points (its GPU test)."""
    x, gate, up = rand(3, 5, 72, seed=13), rand(24, 72, seed=14), rand(24, 72, seed=15)
    got = torch.ops.k26.linear_swiglu(x, torch.cat([gate, up]))
    want = torch.nn.functional.silu(torch.ops.k26.linear(x, gate)) * torch.ops.k26.linear(x, up)
    assert got.shape == (3, 5, 24) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_swiglu_opcheck():
    args = (rand(7, 48, seed=16), rand(40, 48, seed=17))
    torch.library.opcheck(
        torch.ops.k26.linear_swiglu.default, args, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize(
    "x,w,wdtype,match",
    [
        ((3, 64), (16, 32), torch.bfloat16, "x has K=64"),
        ((3, 64), (15, 64), torch.bfloat16, "weight must be the stacked \\[gate; up\\] .*got \\[15, 64\\]"),
        ((3, 64), (16, 64, 1), torch.bfloat16, "weight must be the stacked \\[gate; up\\]"),
        ((3, 64), (16, 64), torch.float32, "weight dtype torch.float32 differs"),
    ],
)
def test_swiglu_bad_inputs_are_named(x, w, wdtype, match):
    with pytest.raises(ValueError, match=f"k26.linear_swiglu: {match}"):
        torch.ops.k26.linear_swiglu(rand(*x), rand(*w, dtype=wdtype))
