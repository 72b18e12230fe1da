"""The one-token MoE block in two launches (torch.ops.k26.moe_one_token): schema and input checks on CPU; on
the GPU, on fresh random weights and rows, the same bits as the split path (moe_router, then
moe_w4a16_repacked), the reference within tolerance, graph replays that follow new inputs and leave the
router's scratch re-armed, two launches, and the model (opted in) taking it for one token without changing a
bit."""

import pytest
import torch
from oracles import poison_allocator
from test_moe_router import router_inputs

import k26.ops  # noqa: F401  (registers the ops)
from k26.ops import pdl, reference
from k26.ops.moe_block_cuda import check_inputs
from k26.ops.moe_cuda import repacked_reference
from k26.ops.moe_layout import repack_experts
from k26.ops.router_cuda import router_barrier

gpu = pytest.mark.gpu
ROUTE = (1, 1, 8, True, 2.827)  # n_group, topk_group, topk, renormalize, scale: K2.6's


def cpu_block(E=16, D=64, inter=64, topk=4, seed=0):
    from oracles import random_int4_experts

    g = torch.Generator().manual_seed(seed)
    experts = repack_experts(*random_int4_experts(E, D, inter, g))
    shared = tuple(
        (torch.randn(*s, generator=g) * 0.1).to(torch.bfloat16) for s in ((inter, D), (inter, D), (D, inter))
    )
    x, w, bias = router_inputs(1, E, D, seed=seed)
    return x, (w, bias, router_barrier("cpu"), 4, 2, topk, True, 1.5), experts, shared


def test_one_token_opcheck():
    x, router, experts, shared = cpu_block()
    for sh in ((), shared):
        torch.library.opcheck(
            torch.ops.k26.moe_one_token.default,
            (x, *router, *experts, *sh),
            test_utils=("test_schema", "test_faketensor"),
        )


@pytest.mark.parametrize(
    "change,match",
    [
        ({"x": torch.zeros(2, 64, dtype=torch.bfloat16)}, "one token, .*got M=2"),
        ({"topk": 9, "n_group": 1, "topk_group": 1}, "topk <= 8"),  # (one group: the router's check passes)
        ({"weight": torch.zeros(8, 64, dtype=torch.bfloat16), "bias": torch.zeros(8)}, "scores E=8 .* 16"),
        ({"shared": (torch.zeros(3, 64, dtype=torch.bfloat16), None, None)}, "shared_gate must be bf16"),
        ({"barrier": torch.zeros(3, dtype=torch.int32)}, "barrier must be int32"),
    ],
)
def test_bad_inputs_are_named(change, match):
    x, router, (w13, s13, w2, s2), shared = cpu_block()
    kw = dict(
        zip(("weight", "bias", "barrier", "n_group", "topk_group", "topk"), router[:6], strict=True),
        x=x,
        w13=w13,
        s13=s13,
        w2=w2,
        s2=s2,
        shared=shared,
    )
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        check_inputs(**kw)


def gpu_block(seed, E=384, D=7168, inter=256, hot=0, with_shared=True):
    """Fresh repacked experts and shared expert (test_moe_gpu's draws), a router like a trained one (`hot`
    experts favoured by the bias: skewed routing), one token."""
    from test_moe_gpu import random_repacked, shared_weights

    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts = random_repacked(E, D, inter, gen)
    shared = shared_weights(D, inter, gen) if with_shared else ()
    x, w, bias = router_inputs(1, E, D, device="cuda", seed=seed, hot=hot)
    return x, (w, bias, router_barrier("cuda")), experts, shared


def split_path(x, router, experts, shared, route=ROUTE):
    tw, ids = torch.ops.k26.moe_router(x, *router, *route)
    return torch.ops.k26.moe_w4a16_repacked(x, *experts, ids, tw, *shared)


@gpu
@pytest.mark.parametrize(
    "E,D,inter,route,hot,with_shared",
    [
        (384, 7168, 256, ROUTE, 0, True),  # K2.6 at TP8
        (384, 7168, 256, ROUTE, 10, True),  # skewed
        (384, 7168, 256, ROUTE, 0, False),
        (64, 7168, 2048, ROUTE, 0, True),  # TP1's intermediate (fewer experts: memory)
        (64, 512, 128, (8, 3, 6, False, 1.0), 0, True),  # group-limited, no renormalisation
        (96, 1024, 64, (1, 1, 3, True, 2.5), 0, False),
    ],
)
def test_equals_split_path_bitwise_and_reference(E, D, inter, route, hot, with_shared):
    x, router, experts, shared = gpu_block(30 + E + D + inter + hot, E, D, inter, hot, with_shared)
    want = split_path(x, router, experts, shared, route)
    poison_allocator()
    got = torch.ops.k26.moe_one_token(x, *router, *route, *experts, *shared)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)
    with pdl.disabled():  # each launch waits for the one before: the same bits, no ordering luck
        assert torch.equal(torch.ops.k26.moe_one_token(x, *router, *route, *experts, *shared), want)
    tw, ids = reference.moe_router(x, router[0], router[1], *route)
    exact = repacked_reference(x, *experts, ids, tw, *shared).float()
    assert ((got.float() - exact).norm() / exact.norm()).item() < 1e-2
    assert torch.equal(router[2], torch.zeros_like(router[2])), "the router's scratch is not re-armed"


@gpu
def test_graph_replays_follow_new_inputs_bit_identically():
    x, router, experts, shared = gpu_block(5)
    static = x.clone()
    torch.ops.k26.moe_one_token(static, *router, *ROUTE, *experts, *shared)  # warm (library, caches)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.k26.moe_one_token(static, *router, *ROUTE, *experts, *shared)
    gen = torch.Generator(device="cuda").manual_seed(6)
    for _ in range(3):
        static.copy_(torch.randn(1, x.shape[1], generator=gen, device="cuda").to(torch.bfloat16))
        out.fill_(float("nan"))
        g.replay()
        want = split_path(static, router, experts, shared)
        assert torch.equal(out, want)
    g.replay()
    first = out.clone()
    g.replay()
    assert torch.equal(out, first), "two replays of one input differ"
    assert torch.equal(router[2], torch.zeros_like(router[2]))


@gpu
def test_one_token_block_is_two_launches():
    from test_moe_gpu import _kernel_names

    x, router, experts, shared = gpu_block(7)
    names = _kernel_names(lambda: torch.ops.k26.moe_one_token(x, *router, *ROUTE, *experts, *shared))
    assert len(names) == 2, names
    assert any("router_kernel" in k and "GateUpArgs" in k for k in names), names
    assert any("down_combine_one_token" in k for k in names), names


@gpu
def test_model_opted_in_takes_the_two_launch_block_for_one_token_without_changing_a_bit(tiny_k25):
    from k26 import LLM

    llm = LLM(tiny_k25, device="cuda", progress=False)
    moe = llm.model.layers[1].mlp
    assert not moe.gate.one_token_block  # opt-in: measured slower than router + expert op
    moe.gate.one_token_block = True
    gen = torch.Generator("cuda").manual_seed(9)
    x = torch.randn(1, 1, moe.gate.weight.shape[1], generator=gen, device="cuda").to(torch.bfloat16)
    assert moe.gate.serves_block(x.flatten(0, 1))
    from test_moe_gpu import _kernel_names

    with torch.no_grad():
        two = moe(x, partial=True)
        two_names = _kernel_names(lambda: moe(x, partial=True))
        moe.gate.one_token_block = False
        three = moe(x, partial=True)
    assert any("GateUpArgs" in k for k in two_names), two_names
    assert torch.isfinite(two.float()).all() and torch.equal(two, three)
