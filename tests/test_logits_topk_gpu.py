"""torch.ops.k26.logits_topk on the device: the CUDA kernels give the reference's values and columns exactly
(fresh random rows over poisoned outputs; ties at the k-th value, NaN, infinities and -0.0; chunk edges) and
its log-sum-exp to fp32 rounding, graph replays follow new inputs, and shapes the kernels do not hold run the
reference."""

import pytest
import torch

from k26.ops import reference

pytestmark = pytest.mark.gpu


def poison_allocator() -> None:
    junk = torch.full((64 << 20,), -1, dtype=torch.int8, device="cuda")
    del junk


def assert_equals_reference(x: torch.Tensor, k: int) -> None:
    want = reference.logits_topk(x.cpu(), k)
    poison_allocator()
    v, i, lse = torch.ops.k26.logits_topk(x, k)
    torch.cuda.synchronize()
    assert torch.equal(i.cpu(), want[1]), "columns"
    assert torch.equal(v.cpu().view(torch.int32), want[0].view(torch.int32)), "value bits (-0.0, NaN)"
    torch.testing.assert_close(lse.cpu(), want[2], rtol=2e-6, atol=2e-6, equal_nan=True)


# (rows, columns, k): the drafter's TP8 shard (20,480) and whole vocabulary (163,840) at the budgets' k, one
# chunk and a column past it (4,097), a chunk's edge, one column, k = 1 (DFlash), k = 64 (the kernel's most),
# 64 chunks of 64 candidates (262,144: the merge block full).
@pytest.mark.parametrize(
    "R, V, k",
    [
        (15, 20480, 15),
        (15, 20480, 31),
        (15, 20480, 64),
        (3, 163840, 31),
        (2, 4097, 64),
        (3, 4096, 7),
        (1, 1, 1),
        (4, 100, 1),
        (2, 262144, 64),
        (5, 777, 64),
    ],
)
def test_kernel_equals_reference_on_random_rows(R, V, k):
    g = torch.Generator().manual_seed(R * V + k)
    assert_equals_reference((torch.randn(R, V, generator=g) * 3).cuda(), k)


@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize("R, V, k", [(4, 20480, 15), (2, 9000, 64), (3, 300, 31)])
def test_ties_at_the_kth_value_go_to_the_lower_columns(R, V, k, steps):
    g = torch.Generator().manual_seed(steps + V)
    x = -(torch.randint(0, steps, (R, V), generator=g).float() / 4)  # a few values: ties everywhere, -0.0 too
    assert_equals_reference(x.cuda(), k)


def test_nan_infinities_and_signed_zeros_rank_as_the_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 10000, generator=g)
    x[0, [5, 9000]] = float("nan")
    x[1, [7, 4500, 9999]] = float("inf")
    x[2, :] = float("-inf")
    x[3, ::3] = -0.0
    x[3, 1::3] = 0.0
    x[4, 4096:] = float("-inf")
    x[5, [1, 8000]] = float("-inf")
    assert_equals_reference(x.cuda(), 20)


# Rows whose log-sum-exp the chunks' merge must get as torch.logsumexp does: a chunk of -inf only beside
# logits far below 0 (its max must not shift the others), +inf in one chunk beside a large finite max in
# another, -inf and NaN alone (found in review: the first version gave -inf or 0.005 off, NaN for +inf).
def test_the_log_sum_exp_of_chunks_without_a_finite_logit():
    x = torch.full((5, 8193), float("-inf"))
    x[0, 4096] = -200.0
    x[1, 4096:] = -100.0 + torch.randn(4097, generator=torch.Generator().manual_seed(1))
    x[2, 4096:] = 0.0
    x[2, 0], x[2, 8192] = float("inf"), 200.0
    x[4, 8000] = float("nan")
    assert_equals_reference(x.cuda(), 3)


def test_leading_dimensions_are_kept():
    x = torch.randn(2, 7, 5000, device="cuda")
    v, i, lse = torch.ops.k26.logits_topk(x, 9)
    assert v.shape == (2, 7, 9) and i.shape == (2, 7, 9) and lse.shape == (2, 7)
    assert torch.equal(x.gather(-1, i), v)


def test_graph_replays_follow_new_inputs():
    x = torch.randn(15, 20480, device="cuda")
    outs = []
    g = torch.cuda.CUDAGraph()
    torch.ops.k26.logits_topk(x, 15)  # warm-up (the library, the allocator)
    with torch.cuda.graph(g):
        outs.extend(torch.ops.k26.logits_topk(x, 15))
    for seed in range(3):
        x.copy_(torch.randn(15, 20480, generator=torch.Generator().manual_seed(seed)).cuda() * 3)
        g.replay()
        eager = torch.ops.k26.logits_topk(x, 15)
        for a, b in zip(outs, eager, strict=True):
            assert torch.equal(a, b)  # the same bits as an eager call
        assert torch.equal(outs[1].cpu(), reference.logits_topk(x.cpu(), 15)[1])


# k above 64; more candidates than a merge block holds: torch.topk over unique keys (topk_cuda.keyed_topk)
@pytest.mark.parametrize("V, k", [(20480, 65), (300000, 64)])
def test_shapes_the_kernels_do_not_hold_give_the_references_results(V, k):
    x = -(torch.randint(0, 5, (2, V), generator=torch.Generator().manual_seed(V)).float() / 4)  # ties
    assert_equals_reference(x.cuda(), k)
