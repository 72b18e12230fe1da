"""The glue + q_b kernel (csrc/mla_glue_qb.cu) against the two ops it replaces, mla_glue then linear (their
own kernels), on fresh random inputs at K2.6's TP8 shapes: the same bits for q_b and for the cache (which is
poisoned around the written rows and must stay so), q_a as the stacked projection's strided view, 1 .. 16
tokens in several batch splits, with and without programmatic dependent launch, graph replay == eager; past 16
tokens the op runs the two ops (the same bits by definition)."""

import contextlib

import pytest
import torch
from test_glue_gpu import inputs

import k26.ops  # noqa: F401  (registers the ops)
from k26.ops import pdl

pytestmark = pytest.mark.gpu

NQ = 8 * 192  # q_b rows at TP8: 8 heads x (128 nope + 64 rope)


def weight(seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(NQ, 1536, generator=gen, device="cuda") * 0.03).bfloat16()


def poisoned(a: dict) -> dict:
    """The inputs with the whole cache set to NaN (the call writes its rows; every other stays NaN)."""
    a["cache"].fill_(float("nan"))
    return a


def run_both(a: dict, w: torch.Tensor):
    want_cache = a["cache"].clone()
    want = torch.ops.k26.linear(torch.ops.k26.mla_glue(**(a | {"cache": want_cache})), w)
    got = torch.ops.k26.mla_glue_qb(*a.values(), w)
    return got, want, want_cache


@pytest.mark.parametrize("B, N", [(1, 1), (2, 1), (1, 5), (1, 8), (3, 3), (1, 9), (1, 16), (4, 4), (2, 8)])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("with_pdl", [True, False])
def test_glue_qb_is_bitwise_glue_then_linear(B, N, stacked, with_pdl):
    a, w = poisoned(inputs(B, N, seed=31 * B + N, stacked=stacked)), weight(B * 7 + N)
    with contextlib.nullcontext() if with_pdl else pdl.disabled():
        got, want, want_cache = run_both(a, w)
    assert torch.isfinite(got).all() and got.abs().max() > 0
    assert torch.equal(got, want)
    assert torch.equal(a["cache"].isnan(), want_cache.isnan())  # the same rows written, no other touched
    assert torch.equal(a["cache"].nan_to_num(), want_cache.nan_to_num())


def test_odd_widths_match_the_two_ops():
    """Q = 2072 (a second q chunk on some threads, K not a multiple of 32), 200 q_b rows (a clamped tile)."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, r, p, nq, B, N = 2072, 512, 64, 200, 2, 5
    base = inputs(B, N, seed=9)
    a = base | {
        "q_a": (torch.randn(B, N, q, generator=gen, device="cuda") * 3).bfloat16(),
        "q_norm_weight": (torch.randn(q, generator=gen, device="cuda") + 1).bfloat16(),
    }
    w = (torch.randn(nq, q, generator=gen, device="cuda") * 0.03).bfloat16()
    assert a["kv_a"].shape[-1] == r + p
    got, want, want_cache = run_both(poisoned(a), w)
    assert torch.equal(got, want) and torch.equal(a["cache"].nan_to_num(), want_cache.nan_to_num())


def test_q_a_from_the_kernel_just_before_is_read_after_its_wait():
    """q_a / kv_a as the model has them: views of the stacked projection's output, launched just before (PDL
    on): a read of them before the grid-dependency wait would see the poisoned pool."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    a = inputs(1, 16, seed=21)
    x = (torch.randn(1, 16, 1024, generator=gen, device="cuda")).bfloat16()
    w_a = (torch.randn(1536 + 512 + 64, 1024, generator=gen, device="cuda") * 0.05).bfloat16()
    w = weight(21)
    cache0 = a["cache"].clone()
    torch.full((1 << 27,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the free pool
    stacked = torch.ops.k26.linear(x, w_a)
    views = {"q_a": stacked[..., :1536], "kv_a": stacked[..., 1536:]}
    got = torch.ops.k26.mla_glue_qb(*(a | views).values(), w)
    torch.cuda.synchronize()
    ref = a | views | {"cache": cache0}
    want = torch.ops.k26.linear(torch.ops.k26.mla_glue(**ref), w)
    assert torch.equal(got, want) and torch.equal(a["cache"], cache0)


def test_more_than_16_tokens_run_the_two_ops_without_error():
    a, w = poisoned(inputs(2, 9, seed=5)), weight(5)
    got, want, want_cache = run_both(a, w)
    assert torch.equal(got, want) and torch.equal(a["cache"].nan_to_num(), want_cache.nan_to_num())


def test_graph_replay_matches_eager():
    a, w = inputs(2, 8, seed=3, stacked=True), weight(3)
    torch.ops.k26.mla_glue_qb(*a.values(), w)  # the library loaded before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.k26.mla_glue_qb(*a.values(), w)
    fresh = inputs(2, 8, seed=4, stacked=True)
    for k in ("q_a", "kv_a", "positions", "rows", "prefix_lens"):
        a[k].copy_(fresh[k])
    before = a["cache"].clone()
    g.replay()
    got, want, want_cache = run_both(a | {"cache": before}, w)
    assert torch.equal(out, want) and torch.equal(a["cache"], want_cache)
    assert torch.equal(got, want) and torch.equal(before, want_cache)  # and eager == replay
