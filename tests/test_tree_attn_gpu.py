"""The MLA tree-attention CUDA kernel against the pure-torch reference, on random data and random trees."""

import pytest
import torch

from k26.ops import reference, tree_mask_to_words
from k26.spec.tree import ancestors_from_parents

pytestmark = pytest.mark.gpu


def random_ancestors(B, N, gen):
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, N)] for _ in range(B)]
    return ancestors_from_parents(torch.tensor(parents))


def case(B, N, H, lens, seed, causal=False):
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device="cuda").manual_seed(seed)  # long caches: drawn on the device
    max_len = max(lens) + N + 3
    cache = torch.randn(B + 1, max_len, 576, generator=dgen, device="cuda").to(torch.bfloat16)
    q = (torch.randn(B, N, H, 576, generator=dgen, device="cuda") * 0.5).to(torch.bfloat16)
    rows = torch.randperm(B + 1, generator=gen)[:B].cuda()
    prefix = torch.tensor(lens).cuda()
    anc = torch.ones(B, N, N, dtype=torch.bool).tril() if causal else random_ancestors(B, N, gen)
    words = tree_mask_to_words(anc).cuda()
    return q, cache, rows, prefix, words


def rope_args(prefix, N):
    """The new tokens' RoPE positions (after each sequence's prefix) and 32 YaRN-like frequencies."""
    positions = prefix[:, None] + torch.arange(N, device="cuda")
    return positions, 1.0 / (50000.0 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))


def poison():
    torch.full((1 << 27,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def compare(args, scale=0.1446796, rotary=()):
    """The kernel against the reference on case()'s inputs; `rotary`: the model's split-query arguments
    (static, q_pe, positions, inv_freq), args' q then being the first 512 dims."""
    ref_o, ref_l = reference.mla_tree_attention(*args, scale, 512, *rotary)
    poison()
    out, lse = torch.ops.k26.mla_tree_attention(*args, scale, 512, *rotary)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
    lerr = (lse - ref_l).abs().max().item()
    assert err <= 3e-3 and lerr <= 1e-3, (err, lerr)


# The grid of the attention-v2 issue: fresh random trees and lengths; the reference's fp32 scores must fit.
GRID = [
    (N, L, H)
    for H in (8, 16, 64)
    for N in (1, 2, 7, 16, 63, 64, 65, 200, 256)
    for L in (0, 1, 63, 64, 65, 4095, 20011, 131071)
    if N * H * (L + N) <= 3 * 2**28
]


@pytest.mark.parametrize("N, L, H", GRID)
def test_matches_reference_on_the_issue_grid(N, L, H):
    compare(case(1, N, H, [L], seed=1000 * N + 7 * H + L))


@pytest.mark.parametrize("N, L, H", GRID)
def test_rotary_query_matches_reference_on_the_issue_grid(N, L, H):
    """The same grid with the query as the model passes it (RoPE and the concatenation in the kernel)."""
    q, cache, rows, prefix, words = case(1, N, H, [L], seed=1000 * N + 7 * H + L + 1)
    positions, inv_freq = rope_args(prefix, N)
    compare(
        (q[..., :512].contiguous(), cache, rows, prefix, words),
        rotary=(False, q[..., 512:], positions, inv_freq),
    )


@pytest.mark.parametrize("B, N, H", [(2, 1, 8), (4, 7, 8), (4, 16, 16), (3, 65, 8), (2, 200, 8)])
def test_batches_with_mixed_lengths_match_reference(B, N, H):
    gen = torch.Generator().manual_seed(B * N * H)
    lens = [int(x) for x in torch.randint(0, 9000, (B,), generator=gen)]
    lens[0] = 0
    compare(case(B, N, H, lens, seed=B + N + H))


def test_results_are_bitwise_deterministic():
    args = case(1, 16, 8, [50000], seed=21)
    a = torch.ops.k26.mla_tree_attention(*args, 0.1, 512)
    b = torch.ops.k26.mla_tree_attention(*args, 0.1, 512)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_many_graph_replays_with_changing_lengths_stay_exact():
    """The merge counters live in a reused workspace and are reset by the kernel: every replay is checked."""
    q, cache, rows, prefix, words = case(2, 4, 8, [30000, 20000], seed=22)
    torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, 0.1, 512)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, 0.1, 512)
    gen = torch.Generator().manual_seed(23)
    for _ in range(50):
        prefix.copy_(torch.randint(0, cache.shape[1] - 4, (2,), generator=gen))
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
        out.fill_(float("nan"))
        g.replay()
        ref_o, ref_l = reference.mla_tree_attention(q, cache, rows, prefix, words, 0.1, 512)
        assert ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item() <= 3e-3
        assert (lse - ref_l).abs().max().item() <= 1e-3


def test_back_to_back_calls_with_changing_split_counts_share_the_merge_barrier():
    """One workspace (one barrier per row tile) serves consecutive calls whose live split counts differ —
    one split (no barrier), a few, hundreds, a whole wave — in one graph replayed back to back without a
    host sync between replays: every call of every replay matches the reference."""
    q, cache, rows, _, words = case(1, 1, 8, [120000], seed=24)
    # Live splits at 64 keys a split and 264 splits (an H200): 1, 79, 2, 257, 1, 11, 1, 258, and 264 (L + 1 =
    # 264 x 256: every block of the grid takes part).
    lens = [10, 5000, 64, 119000, 1, 700, 62, 33000, 67583]
    prefixes = [torch.tensor([n], device="cuda") for n in lens]
    torch.ops.k26.mla_tree_attention(q, cache, rows, prefixes[0], words, 0.1, 512)  # load before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [torch.ops.k26.mla_tree_attention(q, cache, rows, p, words, 0.1, 512) for p in prefixes]
    refs = [reference.mla_tree_attention(q, cache, rows, p, words, 0.1, 512) for p in prefixes]
    results = []
    for _ in range(20):
        for out, lse in outs:
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        g.replay()
        results.append([(out.clone(), lse.clone()) for out, lse in outs])
    torch.cuda.synchronize()
    for replay in results:
        for (out, lse), (ref_o, ref_l), n in zip(replay, refs, lens, strict=True):
            err = ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
            assert err <= 3e-3 and (lse - ref_l).abs().max().item() <= 1e-3, (n, err)
    for a, b in zip(results[0], results[-1], strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("N", [1, 2, 7, 8, 16, 64, 128, 256])
def test_tree_sizes(N):
    compare(case(1, N, 8, [1000], seed=N))


@pytest.mark.parametrize("H", [8, 16, 64])
def test_heads(H):
    compare(case(1, 16, H, [3000], seed=H))


@pytest.mark.parametrize("L", [0, 1, 15, 17, 255, 4096, 16384])
def test_prefix_lengths(L):
    compare(case(1, 8, 8, [L], seed=L))


def test_long_prefix_decode():
    compare(case(1, 1, 8, [131072], seed=7))


def test_long_prefix_tree():
    compare(case(1, 64, 8, [65536], seed=8))


def test_batch_with_mixed_lengths():
    compare(case(3, 16, 16, [0, 777, 5000], seed=9))


def test_causal_chain():
    compare(case(2, 16, 8, [100, 2000], seed=10, causal=True))


def test_graph_replay_follows_new_lengths():
    q, cache, rows, prefix, words = case(2, 16, 8, [3000, 1500], seed=11)
    torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, 0.1, 512)  # load before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, 0.1, 512)
    prefix.copy_(torch.tensor([10, 2900]))
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))
    g.replay()
    ref_o, ref_l = reference.mla_tree_attention(q, cache, rows, prefix, words, 0.1, 512)
    assert ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item() <= 3e-3
    assert (lse - ref_l).abs().max().item() <= 1e-3


def test_refuses_overflowing_prefix():
    q, cache, rows, prefix, words = case(1, 8, 8, [100], seed=12)
    prefix.fill_(cache.shape[1])
    with pytest.raises(ValueError, match="exceeds the cache length"):
        torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, 0.1, 512)


def test_refuses_bad_mask_shape():
    q, cache, rows, prefix, words = case(1, 8, 8, [100], seed=13)
    with pytest.raises(ValueError, match="mask_words must be int64"):
        torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words[:, :4], 0.1, 512)


def rotary_case(B, N, H, L, seed):
    """case()'s inputs with the query split as the model passes it: q̃ [B, N, H, 512] and q_pe a strided
    view of a q_b-like output [B, N, H, 192] (its last 64 dims, before RoPE), positions, frequencies."""
    q, cache, rows, prefix, words = case(B, N, H, [L] * B, seed)
    dgen = torch.Generator(device="cuda").manual_seed(seed + 1)
    q_b = (torch.randn(B, N, H, 192, generator=dgen, device="cuda") * 0.5).to(torch.bfloat16)
    positions, inv_freq = rope_args(prefix, N)
    return q[..., :512].contiguous(), q_b[..., 128:], positions, inv_freq, cache, rows, prefix, words


@pytest.mark.parametrize(
    "B, N, H, L", [(1, 1, 8, 4095), (2, 16, 8, 1000), (1, 65, 16, 300), (2, 7, 64, 20011)]
)
def test_rotary_query_equals_the_concatenated_query_bitwise(B, N, H, L):
    q_lat, q_pe, pos, freq, cache, rows, prefix, words = rotary_case(B, N, H, L, seed=20 + N)
    assert not q_pe.is_contiguous()  # read in place, rows 192 apart
    q_abs = torch.cat([q_lat, reference.rope(q_pe, pos[:, :, None], freq)], dim=-1)
    want_o, want_l = torch.ops.k26.mla_tree_attention(q_abs, cache, rows, prefix, words, 0.1, 512)
    poison()
    out, lse = torch.ops.k26.mla_tree_attention(
        q_lat, cache, rows, prefix, words, 0.1, 512, False, q_pe, pos, freq
    )
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    ref_o, ref_l = reference.mla_tree_attention(
        q_lat, cache, rows, prefix, words, 0.1, 512, False, q_pe, pos, freq
    )
    assert ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item() <= 3e-3
    assert (lse - ref_l).abs().max().item() <= 1e-3


def test_rotary_query_refuses_missing_positions():
    q_lat, q_pe, pos, freq, cache, rows, prefix, words = rotary_case(1, 4, 8, 10, seed=30)
    with pytest.raises(ValueError, match="q_pe, positions and inv_freq come together"):
        torch.ops.k26.mla_tree_attention(q_lat, cache, rows, prefix, words, 0.1, 512, False, q_pe, None, freq)
    with pytest.raises(ValueError, match="inv_freq must be float32"):
        torch.ops.k26.mla_tree_attention(
            q_lat, cache, rows, prefix, words, 0.1, 512, False, q_pe, pos, freq.double()
        )


def test_long_and_short_sequences_of_one_batch_and_their_swaps_match_reference():
    """Sequences far apart in length in one call, and each sequence crossing that distance between calls of
    one graph replayed back to back: with -DK26_ATTN_UNION the long ones run the wide body (a split streaming
    >= 1024 keys: from ~33K keys at N = 16, B = 2 on 132 SMs) and the short ones the 32-row body in the
    same launch, each layout with its own merge barriers. Every call of every replay matches the reference."""
    q, cache, rows, _, words = case(2, 16, 8, [100000, 100000], seed=25)
    pairs = [[100000, 3000], [3000, 100000], [100000, 100000], [3000, 3000], [34000, 31000]]
    prefixes = [torch.tensor(p, device="cuda") for p in pairs]
    torch.ops.k26.mla_tree_attention(q, cache, rows, prefixes[0], words, 0.1, 512)  # load before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [torch.ops.k26.mla_tree_attention(q, cache, rows, p, words, 0.1, 512) for p in prefixes]
    refs = [reference.mla_tree_attention(q, cache, rows, p, words, 0.1, 512) for p in prefixes]
    for _ in range(3):
        for out, lse in outs:
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for (out, lse), (ref_o, ref_l), pair in zip(outs, refs, pairs, strict=True):
            err = ((out.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
            assert err <= 3e-3 and (lse - ref_l).abs().max().item() <= 1e-3, (pair, err)


def test_a_batch_past_one_wave_matches_reference():
    """A batch whose plan is one split a row tile (40 x 4 row tiles > a wave of 132 blocks: no merge), long
    enough that -DK26_ATTN_UNION runs the wide body: its layout must then stay at one split too (a barrier
    across waves could wait forever)."""
    gen = torch.Generator().manual_seed(26)
    lens = [int(x) for x in torch.randint(2000, 6000, (40,), generator=gen)]
    compare(case(40, 16, 8, lens, seed=26))
