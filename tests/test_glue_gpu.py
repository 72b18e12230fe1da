"""The MLA glue kernel (csrc/mla_glue.cu) against its pure-torch reference on fresh random inputs at K2.6
shapes, outputs poisoned first: q_a norm, the cache rows written (and no other), strided views of the
stacked projection, large positions, graph replay == eager bitwise; the model with the glue and the stacked
q_a / kv_a projection against the unfused one. The glue fused with the q_b projection
(csrc/mla_glue_linear.cu) against the glue kernel then the small-M linear kernel: the same bits."""

import pytest
import torch

import k26.ops  # noqa: F401  (registers the ops)
from k26.config import K26_TEXT_CONFIG, ModelConfig
from k26.model.rope import Rope
from k26.ops.glue_cuda import mla_glue_reference

pytestmark = pytest.mark.gpu

Q, R, P = 1536, 512, 64


def rand(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


def inputs(B, N, seed, L=4096, stacked=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = rand(B, N, Q + R + P, gen=gen, scale=3.0)
    q_a, kv_a = (a[..., :Q], a[..., Q:]) if stacked else (a[..., :Q].clone(), a[..., Q:].clone())
    rows = torch.randperm(B + 2, device="cuda", generator=gen)[:B]
    prefix = torch.randint(0, L - N, (B,), device="cuda", generator=gen)
    depth = torch.randint(0, N, (B, N), device="cuda", generator=gen)
    return {
        "q_a": q_a,
        "kv_a": kv_a,
        "q_norm_weight": rand(Q, gen=gen) + 1,
        "kv_norm_weight": rand(R, gen=gen) + 1,
        "positions": prefix[:, None] + depth + 200_000 * (seed % 2),  # YaRN range: up to 262K
        "inv_freq": Rope(ModelConfig.from_dict(K26_TEXT_CONFIG).rope, P).inv_freq.cuda(),
        "eps": 1e-6,
        "cache": rand(B + 2, L, R + P, gen=gen),
        "rows": rows,
        "prefix_lens": prefix,
    }


def same_but_rounding(got, ref):
    """Equal up to one bf16 rounding step (the kernel sums the squares in another order)."""
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all()
    assert ((got - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()
    assert (got == ref).float().mean() > 0.95


@pytest.mark.parametrize("B, N", [(1, 1), (1, 16), (4, 16), (3, 5), (2, 64)])
@pytest.mark.parametrize("stacked", [False, True])
def test_glue_matches_reference(B, N, stacked):
    a = inputs(B, N, seed=B * 100 + N, stacked=stacked)
    want_cache = a["cache"].clone()
    want_q = mla_glue_reference(**(a | {"cache": want_cache}))
    torch.full((1 << 27,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the free pool
    got_q = torch.ops.k26.mla_glue(**a)
    same_but_rounding(got_q, want_q)
    same_but_rounding(a["cache"], want_cache)  # the written rows, and every other row untouched
    written = torch.zeros(a["cache"].shape[:2], dtype=torch.bool, device="cuda")
    written[a["rows"][:, None], a["prefix_lens"][:, None] + torch.arange(N, device="cuda")] = True
    k_pe = a["cache"][written][:, R:]
    assert torch.equal(k_pe, want_cache[written][:, R:])  # RoPE: same fp32 arithmetic, bitwise


def test_graph_replay_matches_eager():
    a = inputs(2, 16, seed=7, stacked=True)
    torch.ops.k26.mla_glue(**a)  # load the library before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.k26.mla_glue(**a)
    fresh = inputs(2, 16, seed=8, stacked=True)
    for k in ("q_a", "kv_a", "positions", "rows", "prefix_lens"):
        a[k].copy_(fresh[k])
    g.replay()
    eager_cache = a["cache"].clone()
    g_out = out.clone()
    eager = torch.ops.k26.mla_glue(**(a | {"cache": eager_cache}))
    assert torch.equal(g_out, eager) and torch.equal(a["cache"], eager_cache)


@pytest.mark.parametrize("B, N", [(1, 1), (2, 3), (1, 8), (3, 5), (1, 16), (4, 4), (2, 8)])
@pytest.mark.parametrize("n_out", [1536, 4104])  # K2.6's q_b at TP8 (one wave of tile blocks); 257 tiles
@pytest.mark.parametrize("stacked", [False, True])
def test_glue_linear_is_bitwise_the_two_kernels(B, N, n_out, stacked, monkeypatch):
    from k26.ops import glue_cuda

    monkeypatch.setattr(glue_cuda, "GLUE_LINEAR_MAX_TOKENS", 16)  # the kernel at every row count it serves
    a = inputs(B, N, seed=B * 1000 + N + n_out, stacked=stacked)
    w = rand(n_out, Q, gen=torch.Generator(device="cuda").manual_seed(n_out + N), scale=0.05)
    want_cache = a["cache"].clone()
    want = torch.ops.k26.linear(torch.ops.k26.mla_glue(**(a | {"cache": want_cache})), w)
    torch.full((1 << 27,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the free pool
    got = torch.ops.k26.mla_glue_linear(**a, weight=w)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert torch.equal(a["cache"], want_cache)  # the written rows the same, every other row untouched
    ref_cache = want_cache.clone()
    ref = mla_glue_reference(**(a | {"cache": ref_cache})).float() @ w.float().T
    assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2  # and near the fp32 specification


def _kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("B, N, fused", [(1, 1, True), (1, 2, False), (2, 8, False), (2, 64, False)])
def test_glue_linear_fuses_up_to_its_token_limit(B, N, fused):
    """Up to GLUE_LINEAR_MAX_TOKENS (one) the fused kernel runs alone; above, the glue and linear kernels."""
    a = inputs(B, N, seed=40 + N)
    w = rand(1536, Q, gen=torch.Generator(device="cuda").manual_seed(41), scale=0.05)
    torch.ops.k26.mla_glue_linear(**a, weight=w)  # load the library first
    names = _kernels(lambda: torch.ops.k26.mla_glue_linear(**a, weight=w))
    assert any("mla_glue_linear_kernel" in n for n in names) == fused, names
    assert any("mla_glue_kernel" in n for n in names) != fused, names
    assert any("linear_tile_kernel" in n for n in names) != fused, names


def test_glue_linear_graph_replay_matches_eager(monkeypatch):
    from k26.ops import glue_cuda

    monkeypatch.setattr(glue_cuda, "GLUE_LINEAR_MAX_TOKENS", 16)
    a = inputs(2, 8, seed=17, stacked=True)
    w = rand(1536, Q, gen=torch.Generator(device="cuda").manual_seed(18), scale=0.05)
    torch.ops.k26.mla_glue_linear(**a, weight=w)  # load the library before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.k26.mla_glue_linear(**a, weight=w)
    fresh = inputs(2, 8, seed=19, stacked=True)
    for k in ("q_a", "kv_a", "positions", "rows", "prefix_lens"):
        a[k].copy_(fresh[k])
    out.fill_(float("nan"))
    g.replay()
    eager_cache = a["cache"].clone()
    g_out = out.clone()
    eager = torch.ops.k26.mla_glue_linear(**(a | {"cache": eager_cache}), weight=w)
    assert torch.equal(g_out, eager) and torch.equal(a["cache"], eager_cache)


def test_float32_runs_the_reference():
    a = inputs(1, 3, seed=9)
    a = {k: (v.float() if torch.is_tensor(v) and v.dtype == torch.bfloat16 else v) for k, v in a.items()}
    want_cache = a["cache"].clone()
    assert torch.equal(torch.ops.k26.mla_glue(**a), mla_glue_reference(**(a | {"cache": want_cache})))
    assert torch.equal(a["cache"], want_cache)


def test_loaded_model_is_fused_and_graphs_equal_eager(tiny_k25, drafter_dir):
    from oracles import random_prompts

    from k26 import LLM, SamplingParams, SpecConfig

    kw = {"drafter": drafter_dir, "device": "cuda", "progress": False, "max_batch": 2, "max_model_len": 256}
    graphed, eager = LLM(tiny_k25, graphs=True, **kw), LLM(tiny_k25, graphs=False, **kw)
    assert all(layer.self_attn.qkv_a is not None for layer in graphed.model.layers)  # the loader fused
    ps, sp = random_prompts(2, 3, 30, 4), SamplingParams(max_tokens=24, stop_token_ids=[])
    for spec in (SpecConfig("ar"), SpecConfig("ddtree", 5)):
        a = graphed.generate(ps, sp, spec)
        eager.decoder.ctx.static = True  # the sync-free code path the graphs captured
        try:
            b = eager.generate(ps, sp, spec)
        finally:
            eager.decoder.ctx.static = False
        assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_fused_model_matches_unfused(tiny_k25):
    from k26 import LLM
    from k26.model.mla import MLA

    llm = LLM(tiny_k25, device="cuda", progress=False, cuda_kernels=False)  # unfused: cuBLAS, the module glue
    ids = torch.randint(0, 600, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    for layer in llm.model.layers:
        layer.self_attn.glue = False
    b = llm.score(ids)
    for layer in llm.model.layers:
        layer.self_attn.glue = MLA.glue
        layer.self_attn.fuse_(kernel_max_m=64, short_k_max_m=64)  # every MLA projection in the kernel
    a = llm.score(ids)
    assert ((a - b).norm() / b.norm()).item() < 2e-2
