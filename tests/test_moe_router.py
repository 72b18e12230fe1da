"""The fused MoE router (torch.ops.k26.moe_router): the reference's properties on CPU, the input checks,
and the CUDA kernel against the reference on fresh random rows (GPU)."""

import pytest
import torch
from oracles import poison_allocator

import k26.ops  # noqa: F401  (registers the ops)
from k26.ops import reference
from k26.ops.moe_cuda import pick_nt, route_table, route_table_groups
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


@pytest.mark.parametrize("shift", [0.0, -5.0], ids=["positive_scores", "negative_scores"])
def test_reference_keeps_only_the_best_groups(shift):
    """Experts outside the best groups never win, also where every biased score is negative (so the dropped
    groups' scores must become -inf, not 0)."""
    x, w, bias = router_inputs(64, 64, 128, seed=1)
    bias = bias + shift
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


def test_router_table_opcheck_and_table_size_follows_pick_nt():
    """moe_router_table: schema and fake agree with the reference; the table is sized for the expert op's
    own group width (pick_nt of the pair count), which the op derives rather than takes."""
    from k26.ops.moe_cuda import route_table_size

    for M, E in ((6, 16), (50, 16), (300, 40)):  # nt = 1, 2, 4 at top-3
        x, w, bias = router_inputs(M, E, 64, seed=M)
        groups = (4, 2) if E == 16 else (1, 1)
        args = (x, w, bias, router_barrier("cpu"), *groups, 3, True, 1.5, True)
        torch.library.opcheck(
            torch.ops.k26.moe_router_table.default, args, test_utils=("test_schema", "test_faketensor")
        )
        table = torch.ops.k26.moe_router_table(*args)[2]
        assert table.numel() == route_table_size(M, 3, E, pick_nt(M * 3, E), True)


def canonical_table(table, M, K, E, nt, shared):
    """(group count, [(expert, start, len)], {expert: its pair slots sorted}): the table as the expert op
    reads it. The kernel orders an expert's pairs arbitrarily (so an expert of several groups may split its
    pairs differently) and leaves the groups past the count unwritten; the expert op depends on neither."""
    P, S = M * K, M if shared else 0
    G = route_table_groups(M, K, E, nt, shared)
    t = table.tolist()
    n, slots = t[0], t[1 : 1 + P + S]
    expert, start, length = (t[1 + P + S + i * G : 1 + P + S + i * G + n] for i in range(3))
    pairs: dict[int, list[int]] = {}
    for e, s, n_ in zip(expert, start, length, strict=True):
        pairs.setdefault(e, []).extend(slots[s : s + n_])
    return n, list(zip(expert, start, length, strict=True)), {e: sorted(v) for e, v in pairs.items()}


def assert_same_table(got, want):
    assert got[0] == want[0], f"group count {got[0]} != {want[0]}"
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(got[1], want[1], strict=True)) if a != b]
    assert not bad, f"groups (expert, start, len) differ, first: {bad[0]}"
    bad = [(e, got[2][e], want[2].get(e)) for e in got[2] if got[2][e] != want[2].get(e)]
    assert not bad and got[2].keys() == want[2].keys(), f"an expert's pairs differ, first: {bad[:1]}"


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
        ({"topk": 9}, "topk=9 exceeds the 8 experts of topk_group=2 groups"),  # (took dropped groups')
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
    assert barrier.tolist() == [0] * 5  # left armed for the next call


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


@gpu
@pytest.mark.parametrize("M", [1, 2, 5, 16, 33, 64, 65, 300, 400])  # 400 x 8 pairs over 384: nt = 2
@pytest.mark.parametrize(
    "E,D,topk,hot,shared",
    [(384, 7168, 8, 0, True), (384, 7168, 8, 10, True), (384, 7168, 8, 0, False), (40, 256, 3, 0, True)],
)
def test_router_table_equals_route_table_of_its_ids(M, E, D, topk, hot, shared):
    """The table the router kernel's last block builds is the torch route_table of the ids it returns (same
    groups, same pairs in each), and ids / weights are moe_router's bit for bit; the counters end at zero."""
    x, w, bias = router_inputs(M, E, D, device="cuda", seed=3 * M + E, hot=hot)
    nt = pick_nt(M * topk, E)
    barrier = router_barrier("cuda")
    plain_w, plain_ids = torch.ops.k26.moe_router(x, w, bias, barrier, 1, 1, topk, True, 2.827)
    poison_allocator()
    args = (x, w, bias, barrier, 1, 1, topk, True, 2.827, shared)
    got_w, got_ids, table = torch.ops.k26.moe_router_table(*args)
    assert torch.equal(got_w, plain_w) and torch.equal(got_ids, plain_ids)
    want = canonical_table(route_table(got_ids, E, nt, shared), M, topk, E, nt, shared)
    assert_same_table(canonical_table(table, M, topk, E, nt, shared), want)
    assert barrier.tolist() == [0] * 5


@gpu
def test_router_table_graph_replays_follow_new_inputs():
    """Captured once, the router + table replays on new rows: each replay's table is the route_table of that
    replay's ids (the arrival counter re-arms itself), and the expert op fed the table gives the same bits as
    the expert op routing itself."""
    from test_moe_gpu import block_inputs

    M, E, K, D, inter = 16, 384, 8, 7168, 256
    _, ew, sh, x, _, _ = block_inputs(77, M, E, K, D, inter, with_shared=True)
    _, w, bias = router_inputs(M, E, D, device="cuda", seed=5, hot=10)
    barrier, nt = router_barrier("cuda"), pick_nt(M * K, E)
    args = (1, 1, K, True, 2.827, True)

    def block():
        tw, ids, table = torch.ops.k26.moe_router_table(x, w, bias, barrier, *args)
        return tw, ids, table, torch.ops.k26.moe_w4a16_repacked(x, *ew, ids, tw, *sh, table)

    block()  # build/load before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = block()
    for seed in (11, 12, 13):
        x.copy_(torch.randn(M, D, generator=torch.Generator("cuda").manual_seed(seed), device="cuda"))
        g.replay()
        tw, ids, table, y = (t.clone() for t in out)
        want = canonical_table(route_table(ids, E, nt, True), M, K, E, nt, True)
        assert_same_table(canonical_table(table, M, K, E, nt, True), want)
        assert torch.equal(y, torch.ops.k26.moe_w4a16_repacked(x, *ew, ids, tw, *sh))
    assert barrier.tolist() == [0] * 5


@pytest.mark.parametrize(
    "change,match",
    [
        ({"topk": 0}, "topk=0 must be in \\[1, 16\\]"),
        ({"topk": 17}, "topk=17 must be in \\[1, 16\\]"),
        ({"n_group": 3}, "n_group=3 must divide E=16"),
        ({"weight": torch.zeros(16, 32)}, "weight must be \\[E, D=64\\]"),
        ({"bias": torch.zeros(15)}, "bias must be \\[16\\]"),
        ({"topk": 9}, "topk=9 exceeds the 8 experts"),
    ],
)
def test_the_reference_path_names_bad_inputs_too(change, match):
    """On the CPU (any float dtype) the ops ran their reference unchecked: topk = 0 answered nothing, topk 9
    took experts of dropped groups, the others were errors from deep inside torch."""
    x, w, bias = router_inputs(3, 16, 64)
    kw = {"x": x.float(), "weight": w.float(), "bias": bias, "n_group": 4, "topk_group": 2, "topk": 4}
    kw.update(change)
    args = (
        kw["x"],
        kw["weight"],
        kw["bias"],
        router_barrier("cpu"),
        kw["n_group"],
        kw["topk_group"],
        kw["topk"],
    )
    with pytest.raises(ValueError, match=match):
        torch.ops.k26.moe_router(*args, True, 1.0)
    with pytest.raises(ValueError, match=match):
        torch.ops.k26.moe_router_table(*args, True, 1.0, False)
