"""The fused MoE router (torch.ops.k26.moe_router): the reference's properties on CPU, the input checks,
and the CUDA kernel against the reference on fresh random rows (GPU)."""

import pytest
import torch
from oracles import poison_allocator

import k26.ops  # noqa: F401  (registers the ops)
from k26.ops import reference
from k26.ops.router_cuda import check_inputs, router_barrier

gpu = pytest.mark.gpu
NEAR_TIE = 1e-6  # biased scores closer than this may order differently under another summation order


def router_inputs(M, E, D, device="cpu", seed=0, hot=0):
    """Router weight like a trained one (logits of a few units), a small correction bias; `hot` experts
    get a large bias so every token picks among them (skewed routing)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, D, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(E, D, generator=g, device=device) * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, generator=g, device=device) * 0.05
    if hot:
        bias[torch.randperm(E, generator=g, device=device)[:hot]] += 10.0
    return x, w, bias


def test_reference_keeps_only_the_best_groups():
    x, w, bias = router_inputs(64, 64, 128, seed=1)
    n_group, topk_group, topk = 8, 3, 6
    tw, ids = reference.moe_router(x, w, bias, n_group, topk_group, topk, True, 2.5)
    choice = torch.sigmoid(x.float() @ w.float().T) + bias
    group_score = choice.view(64, n_group, -1).topk(2, dim=-1).values.sum(-1)
    best = group_score.topk(topk_group, dim=-1).indices
    assert all(set((ids[t] // 8).tolist()) <= set(best[t].tolist()) for t in range(64))
    torch.testing.assert_close(tw.sum(-1), torch.full((64,), 2.5), rtol=1e-5, atol=1e-5)


def test_router_opcheck():
    x, w, bias = router_inputs(5, 16, 64)
    args = (x, w, bias, router_barrier("cpu"), 4, 2, 3, True, 1.5)
    torch.library.opcheck(
        torch.ops.k26.moe_router.default, args, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize(
    "change,match",
    [
        ({"x": torch.zeros(3, 64)}, "x must be 2-D bf16"),
        ({"weight": torch.zeros(16, 32, dtype=torch.bfloat16)}, "weight must be bf16 \\[E, D=64\\]"),
        ({"bias": torch.zeros(15)}, "bias must be fp32 \\[16\\]"),
        ({"barrier": torch.zeros(2)}, "barrier must be int32"),
        ({"topk": 17}, "topk=17"),
        ({"n_group": 3}, "n_group=3 must divide E=16"),
        ({"topk_group": 5}, "topk_group=5"),
    ],
)
def test_bad_inputs_are_named(change, match):
    x, w, bias = router_inputs(3, 16, 64)
    kw = {
        "x": x,
        "weight": w,
        "bias": bias,
        "barrier": router_barrier("cpu"),
        "n_group": 4,
        "topk_group": 2,
        "topk": 4,
    }
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        check_inputs(**kw)


def count_differences(got_w, got_ids, x, w, bias, n_group, topk_group, topk, scale=2.827):
    """(rows whose top-k set differs, rows of those that are not near-ties); weights of equal sets match."""
    ref_w, ref_ids = reference.moe_router(x, w, bias, n_group, topk_group, topk, True, scale)
    assert ((got_ids >= 0) & (got_ids < w.shape[0])).all()
    choice = torch.sigmoid(x.float() @ w.float().T) + bias
    gs, ord_g = got_ids.sort(-1)
    rs, ord_r = ref_ids.sort(-1)
    same = (gs == rs).all(-1)
    kth = choice.gather(-1, ref_ids).min(-1).values
    bad = 0
    for t in (~same).nonzero().flatten().tolist():
        diff = set(got_ids[t].tolist()) ^ set(ref_ids[t].tolist())
        bad += any(abs(choice[t, e].item() - kth[t].item()) >= NEAR_TIE for e in diff)
    torch.testing.assert_close(
        got_w.gather(-1, ord_g)[same], ref_w.gather(-1, ord_r)[same], rtol=1e-4, atol=1e-5
    )
    return int((~same).sum()), bad


@gpu
def test_topk_sets_equal_reference_on_10000_rows():
    x, w, bias = router_inputs(10_000, 384, 7168, device="cuda", seed=2)
    poison_allocator()
    got_w, got_ids = torch.ops.k26.moe_router(x, w, bias, router_barrier("cuda"), 1, 1, 8, True, 2.827)
    differ, not_tie = count_differences(got_w, got_ids, x, w, bias, 1, 1, 8)
    print(f"top-k sets differing from the reference: {differ} of 10000 rows, all near-ties: {not_tie == 0}")
    assert not_tie == 0 and differ <= 10


@gpu
@pytest.mark.parametrize("M", [1, 2, 3, 8, 9, 16, 17, 33, 64, 65, 300])
@pytest.mark.parametrize(
    "E,D,n_group,topk_group,topk,hot",
    [
        (384, 7168, 1, 1, 8, 0),
        (384, 7168, 1, 1, 8, 10),
        (256, 7168, 8, 4, 8, 0),
        (64, 512, 4, 2, 6, 0),
        (16, 128, 1, 1, 4, 0),
        (40, 256, 1, 1, 3, 0),
    ],
)
def test_kernel_matches_reference(M, E, D, n_group, topk_group, topk, hot):
    x, w, bias = router_inputs(M, E, D, device="cuda", seed=M + E, hot=hot)
    barrier = router_barrier("cuda")
    poison_allocator()
    got_w, got_ids = torch.ops.k26.moe_router(x, w, bias, barrier, n_group, topk_group, topk, True, 2.827)
    assert count_differences(got_w, got_ids, x, w, bias, n_group, topk_group, topk)[1] == 0
    assert barrier.tolist() == [0, 0]  # left armed for the next call


@gpu
def test_graph_replay_is_bit_identical_and_matches_eager():
    x, w, bias = router_inputs(16, 384, 7168, device="cuda", seed=9)
    barrier = router_barrier("cuda")
    args = (1, 1, 8, True, 2.827)
    torch.ops.k26.moe_router(x, w, bias, barrier, *args)  # build/load before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_w, out_ids = torch.ops.k26.moe_router(x, w, bias, barrier, *args)
    x.copy_(router_inputs(16, 384, 7168, device="cuda", seed=10)[0])
    g.replay()
    first = out_w.clone(), out_ids.clone()
    g.replay()
    assert torch.equal(first[0], out_w) and torch.equal(first[1], out_ids)
    eager_w, eager_ids = torch.ops.k26.moe_router(x, w, bias, barrier, *args)
    assert torch.equal(eager_w, out_w) and torch.equal(eager_ids, out_ids)
