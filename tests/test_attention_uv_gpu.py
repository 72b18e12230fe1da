"""`torch.ops.k26.mla_tree_attention_uv` on CUDA (the attention, then W_UV's kernel merging short decode's
splits: csrc/mla_merge_uv.cuh) against the fp32 reference, on fresh random inputs: lengths on both sides of
one split and of the deferral's split bound, batches of mixed lengths, the rotary query, graph replays, and
that the attention really leaves the deferred sequences' merge to W_UV's kernel."""

import pytest
import torch
from test_tree_attn_gpu import random_ancestors

from k26.ops import attention_cuda, attention_uv_cuda, reference, tree_mask_to_words

pytestmark = pytest.mark.gpu

SCALE = 0.1446796


def uv_case(B, N, H, lens, seed, V=128):
    """Fresh random inputs; more than two tokens a sequence form a random tree, fewer a chain."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    max_len = max(lens) + N + 3
    cache = torch.randn(B + 1, max_len, 576, generator=gen, device="cuda").to(torch.bfloat16)
    q = (torch.randn(B, N, H, 576, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    rows = torch.randperm(B + 1, device="cuda")[:B]
    prefix = torch.tensor(lens, device="cuda")
    chain = torch.ones(B, N, N, dtype=torch.bool).tril()
    anc = random_ancestors(B, N, torch.Generator().manual_seed(seed)) if N > 2 else chain
    words = tree_mask_to_words(anc).cuda()
    # W_UV as the model passes it: the value rows of kv_b's weight, a strided view [H, V, 512]
    kv_b = (torch.randn(H, 128 + V, 512, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    return q, cache, rows, prefix, words, kv_b[:, 128:]


def want(q, cache, rows, prefix, words, w_uv, *rot):
    """fp32 reference of W_UV over the attention's (bf16-rounded) output."""
    o, _ = reference.mla_tree_attention(q, cache, rows, prefix, words, SCALE, 512, *rot)
    return torch.einsum("bnhr,hvr->bnhv", o.float(), w_uv.float())


def rel(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


def poison():
    """NaN into the memory the next allocations take: the caching allocator's large pool and its small one
    (blocks of at most 1 MB, where the op's outputs of a few KB come from)."""
    big = torch.full((1 << 27,), float("nan"), device="cuda")
    small = [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(16)]
    torch.cuda.synchronize()
    del big, small


def splits(L, N=1):
    """The live split count of a one-token-tile sequence (csrc/mla_attn_common.cuh split_geometry)."""
    S = attention_cuda.PLANS.plan(attention_cuda.library_bound(), torch.device("cuda"), 1, N, 8)
    T, mk = L + N, attention_cuda.MIN_SPLIT_KEYS
    want_ = max(1, min(S, (T + mk - 1) // mk))
    chunk = ((T + want_ - 1) // want_ + 15) // 16 * 16
    return (T + chunk - 1) // chunk


# Lengths: one split (0, 1, 63), a few (64, 65), 4K decode (64, 65 splits), the deferral's bound (one token:
# 8191 keys 128 splits, 8192 129 merged in the attention; two tokens: 8190 and 8191), long (20011).
LENS = [0, 1, 63, 64, 65, 1000, 4095, 4096, 8190, 8191, 8192, 20011]
# Query rows a sequence: one 16-row tile (decode at TP8 / TP4, two tokens), two 16-row tiles (3 x 8), one
# 32-row tile (4 x 8: W_UV's 32-row blocks), two 32-row tiles, the last part-filled (7 x 8: W_UV's 128-row
# blocks), a verify tree's four (16 x 8).
SHAPES = [(1, 8), (2, 8), (1, 16), (3, 8), (4, 8), (7, 8), (16, 8)]


@pytest.mark.parametrize("L", LENS)
@pytest.mark.parametrize("N, H", SHAPES)
def test_matches_the_reference_on_both_sides_of_the_deferral(N, H, L):
    args = uv_case(1, N, H, [L], seed=100 * N + H + 7 * L)
    ref = want(*args)
    poison()
    y = torch.ops.k26.mla_tree_attention_uv(*args[:5], SCALE, args[5])
    assert torch.isfinite(y).all()
    assert rel(y, ref) <= 3e-3, (L, rel(y, ref))


def test_the_split_counts_of_the_lengths_cover_both_sides_of_the_bound():
    counts = [splits(L) for L in LENS]
    assert 1 in counts and any(1 < s <= attention_uv_cuda.DEFER_MAX_SPLITS for s in counts)
    assert any(s > attention_uv_cuda.DEFER_MAX_SPLITS for s in counts), counts


@pytest.mark.parametrize("B, N", [(2, 1), (4, 1), (2, 4), (4, 2)])
def test_batches_with_mixed_lengths_match_the_reference(B, N):
    lens = [0, 4095, 20011, 700][:B]
    args = uv_case(B, N, 8, lens, seed=31 + B + 10 * N)
    poison()
    y = torch.ops.k26.mla_tree_attention_uv(*args[:5], SCALE, args[5])
    assert rel(y, want(*args)) <= 3e-3


def test_the_rotary_query_matches_the_reference():
    q, cache, rows, prefix, words, w_uv = uv_case(1, 1, 8, [4095], seed=41)
    positions = prefix[:, None] + torch.arange(1, device="cuda")
    inv_freq = 1.0 / (50000.0 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    rot = (False, q[..., 512:], positions, inv_freq)
    ref = want(q[..., :512].contiguous(), cache, rows, prefix, words, w_uv, *rot)
    poison()
    y = torch.ops.k26.mla_tree_attention_uv(
        q[..., :512].contiguous(), cache, rows, prefix, words, SCALE, w_uv, *rot
    )
    assert rel(y, ref) <= 3e-3


def bounds():
    """The loaded library's merge bounds (a -DK26_ATTN_DEFER_VERIFY build merges the verify tree too)."""
    return attention_uv_cuda.merge_bounds(attention_cuda.library_bound())


def test_shapes_it_does_not_merge_run_the_two_kernels_and_match():
    """Shapes past the library's bounds — the default's: three tokens of 8 heads (two tiles), 64 heads, a
    batch of 9 x 8 rows; a verify-deferring build's: 17 tokens of 8 heads, 256 heads, a batch of 17 x 8 rows,
    96 value rows a head at 128 query rows — run attention + linear_grouped and match."""
    shapes = [(1, 3, 8, 128), (1, 1, 64, 128), (9, 1, 8, 128)]
    shapes += [(1, 17, 8, 128), (1, 1, 256, 128), (17, 1, 8, 128), (1, 16, 8, 96)]
    why = attention_uv_cuda._merge_unsupported
    past = [s for s in shapes if why(torch.empty(s[2], s[3], 512), *s[:3], bounds())]
    assert len(past) >= 4, past
    for B, N, H, V in past:
        args = uv_case(B, N, H, [4095] * B, seed=51 + N + B, V=V)
        poison()
        y = torch.ops.k26.mla_tree_attention_uv(*args[:5], SCALE, args[5])
        assert rel(y, want(*args)) <= 3e-3, (B, N, H, V)


def test_the_attention_leaves_deferred_sequences_unmerged():
    """The deferral happens: with the bound the attention writes no output for a sequence of 2..bound splits
    (its poisoned rows stay NaN) and writes it for one split and past the bound."""
    cases = [(1, 30, False), (1, 4096, True), (1, 8191, True), (1, 8192, False), (1, 20011, False)]
    if bounds().seq_rows >= 16 * 8:  # a verify-deferring build: the tree's four tiles of <= 33 splits
        cases += [(16, 20, False), (16, 4096, True), (16, 131000, True)]
    for N, L, deferred in cases:
        q, cache, rows, prefix, words, _ = uv_case(1, N, 8, [L], seed=61 + L)
        out = torch.full((1, N, 8, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch = attention_cuda.attend(
            q, cache, rows, prefix, words, SCALE, None, None, None, attention_uv_cuda.DEFER_MAX_SPLITS, out
        )
        torch.cuda.synchronize()
        assert bool(torch.isnan(launch.out).all()) == deferred, (N, L)
        assert deferred or bool(torch.isfinite(launch.out).all()), (N, L)


@pytest.mark.parametrize("N", [1, 16])
def test_results_are_bitwise_deterministic(N):
    args = uv_case(1, N, 8, [4095], seed=71)
    a = torch.ops.k26.mla_tree_attention_uv(*args[:5], SCALE, args[5])
    b = torch.ops.k26.mla_tree_attention_uv(*args[:5], SCALE, args[5])
    assert torch.equal(a, b)


@pytest.mark.parametrize("N", [1, 16])
def test_one_graph_replayed_back_to_back_follows_lengths_across_the_bound(N):
    """Calls of one graph whose lengths put them at one split, deferred and (one token) merged in the
    attention (the attention's barrier state and W_UV's reads share one workspace), replayed without a host
    sync between replays: every call of every replay matches the reference, the first and last bitwise."""
    q, cache, rows, _, words, w_uv = uv_case(1, N, 8, [120000], seed=81 + N)
    lens = [10, 5000, 64, 119000, 1, 700, 62, 33000, 8191, 8192]
    prefixes = [torch.tensor([n], device="cuda") for n in lens]
    torch.ops.k26.mla_tree_attention_uv(q, cache, rows, prefixes[0], words, SCALE, w_uv)  # loads the kernels
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [torch.ops.k26.mla_tree_attention_uv(q, cache, rows, p, words, SCALE, w_uv) for p in prefixes]
    refs = [want(q, cache, rows, p, words, w_uv) for p in prefixes]
    results = []
    for _ in range(10):
        for y in outs:
            y.fill_(float("nan"))
        g.replay()
        results.append([y.clone() for y in outs])
    torch.cuda.synchronize()
    for replay in results:
        for y, ref, n in zip(replay, refs, lens, strict=True):
            assert rel(y, ref) <= 3e-3, n
    for a, b in zip(results[0], results[-1], strict=True):
        assert torch.equal(a, b)
