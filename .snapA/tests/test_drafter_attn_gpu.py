"""The drafter-attention CUDA kernel (csrc/drafter_attn.cu) against the reference on fresh random inputs:
K2.6's TP 8 and TP 1 shapes and the tiny pair's, ragged context lengths across the split boundaries, slots
past the context poisoned with NaN, outputs and workspaces from a NaN-filled allocator, and CUDA-graph
replays with changed lengths and inputs."""

import pytest
import torch

from k26.ops import reference

pytestmark = pytest.mark.gpu


def poison():
    torch.full((1 << 27,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def case(B, S, Hq, Hkv, hd, lens, seed, T=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = T or max(lens) + 5
    ck = torch.randn(B + 1, T, Hkv, hd, generator=g, device="cuda").to(torch.bfloat16)
    cv = torch.randn(B + 1, T, Hkv, hd, generator=g, device="cuda").to(torch.bfloat16)
    q = (torch.randn(B, S, Hq, hd, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    kb = torch.randn(B, S, Hkv, hd, generator=g, device="cuda").to(torch.bfloat16)
    vb = torch.randn(B, S, Hkv, hd, generator=g, device="cuda").to(torch.bfloat16)
    rows = torch.randperm(B + 1, generator=g, device="cuda")[:B]
    lens_t = torch.tensor(lens, device="cuda")
    for b in range(B):  # what no query may see
        r = int(rows[b])
        ck[r, min(lens[b], T) :] = float("nan")
        cv[r, min(lens[b], T) :] = float("nan")
    return q, ck, cv, kb, vb, rows, lens_t


def check(args, scale):
    want = reference.drafter_attention(*args, scale).float()
    poison()
    got = torch.ops.k26.drafter_attention(*args, scale).float()
    assert torch.isfinite(got).all()
    err = ((got - want).norm() / want.norm()).item()
    assert err <= 5e-3, err


SHAPES = [  # (Hq, Hkv, hd): K2.6 DFlash at TP 8 and TP 1, the tiny pair, a row tile past 64 query rows
    (8, 1, 128),
    (64, 8, 128),
    (4, 2, 64),
    (24, 2, 128),
]


@pytest.mark.parametrize("Hq, Hkv, hd", SHAPES)
@pytest.mark.parametrize("L", [0, 1, 63, 64, 120, 127, 128, 129, 1000, 4096, 20011])
def test_kernel_matches_reference(Hq, Hkv, hd, L):
    check(case(1, 8, Hq, Hkv, hd, [L], seed=L + Hq), hd**-0.5)


@pytest.mark.parametrize("Hq, Hkv, hd", SHAPES[:3])
def test_ragged_batch_matches_reference(Hq, Hkv, hd):
    check(case(3, 8, Hq, Hkv, hd, [5, 3000, 777], seed=Hq), hd**-0.5)


def test_long_context_matches_reference():
    check(case(1, 8, 8, 1, 128, [131071], seed=7), 128**-0.5)


def test_context_past_the_cache_is_clamped():
    args = case(2, 8, 8, 1, 128, [500, 900], seed=3, T=600)
    want = reference.drafter_attention(*args[:6], torch.tensor([500, 600], device="cuda"), 128**-0.5)
    got = torch.ops.k26.drafter_attention(*args, 128**-0.5)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= 5e-3


def test_graph_replays_follow_new_lengths_and_inputs():
    q, ck, cv, kb, vb, rows, lens = case(1, 8, 8, 1, 128, [4000], seed=11)
    scale = 128**-0.5
    torch.ops.k26.drafter_attention(q, ck, cv, kb, vb, rows, lens, scale)  # plan and load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.k26.drafter_attention(q, ck, cv, kb, vb, rows, lens, scale)
    g = torch.Generator(device="cuda").manual_seed(5)
    for L in (4000, 17, 129, 2500, 0):
        lens.fill_(L)
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        kb.copy_(torch.randn(kb.shape, generator=g, device="cuda"))
        graph.replay()
        want = reference.drafter_attention(q, ck, cv, kb, vb, rows, lens, scale).float()
        assert ((out.float() - want).norm() / want.norm()).item() <= 5e-3, L


def test_cache_view_int32_indices_and_misaligned_inputs_match_reference():
    """The eager drafter's path: a view of the live slots of a longer cache (rows further apart than T x Hkv x
    hd), int32 rows / lengths, and a query at an odd element offset (copied to an aligned buffer)."""
    q, ck, cv, kb, vb, rows, lens = case(2, 8, 8, 1, 128, [700, 1500], seed=13, T=2000)
    view_k, view_v = ck[:, :1600], cv[:, :1600]
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    q_odd = buf[1:].view(q.shape)
    q_odd.copy_(q)
    args = (q_odd, view_k, view_v, kb, vb, rows.int(), lens.int())
    packed = (view_k.contiguous(), view_v.contiguous())
    want = reference.drafter_attention(q, *packed, kb, vb, rows, lens, 128**-0.5)
    got = torch.ops.k26.drafter_attention(*args, 128**-0.5)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= 5e-3


def test_pdl_changes_no_bit():
    from k26.ops import pdl

    args = case(1, 8, 64, 8, 128, [3000], seed=17)
    with_pdl = torch.ops.k26.drafter_attention(*args, 128**-0.5)
    with pdl.disabled():
        without = torch.ops.k26.drafter_attention(*args, 128**-0.5)
    assert torch.equal(with_pdl, without)


def test_block_values_as_a_view_of_the_qkv_output_match_reference():
    """The drafter's fused path: k_blk / v_blk are views into one [B, S, (Hq + 2 Hkv) hd] projection output,
    read in place with their token stride."""
    q, ck, cv, kb, vb, rows, lens = case(2, 8, 8, 1, 128, [900, 40], seed=19)
    qkv = torch.randn(2, 8, (8 + 2) * 128, device="cuda").to(torch.bfloat16)
    qkv[..., 8 * 128 : 9 * 128] = kb.flatten(2)
    qkv[..., 9 * 128 :] = vb.flatten(2)
    k_view, v_view = qkv[..., 8 * 128 : 9 * 128].view(2, 8, 1, 128), qkv[..., 9 * 128 :].view(2, 8, 1, 128)
    want = reference.drafter_attention(q, ck, cv, kb, vb, rows, lens, 128**-0.5)
    got = torch.ops.k26.drafter_attention(q, ck, cv, k_view, v_view, rows, lens, 128**-0.5)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= 5e-3
