"""DDTree on the device: tree builder == heap, graph-capturable, greedy lossless (fp32) and near-tie-only
divergence in bf16."""

import pytest
import torch
from oracles import assert_diverges_only_at_near_ties, random_prompts

from k26 import LLM, SamplingParams, SpecConfig
from k26.spec.tree import build_ddtree, build_ddtree_heap

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("budget", [1, 16, 100, 255])
def test_device_tree_is_the_heap_tree(budget):
    lp = torch.log_softmax(torch.randn(2, 7, 3000, generator=torch.Generator().manual_seed(budget)) * 3, -1)
    tree = build_ddtree(lp.cuda(), budget)
    for b, (tok, par, dep) in enumerate(build_ddtree_heap(lp, budget)):
        assert tree.tokens[b, 1:].tolist() == tok[1:] and tree.parents[b].tolist() == par
        assert tree.depths[b].tolist() == dep


def test_tree_build_is_graph_capturable():
    lp = torch.log_softmax(torch.randn(1, 7, 5000, device="cuda"), -1)
    eager = build_ddtree(lp, 32)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        build_ddtree(lp, 32)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tree = build_ddtree(lp, 32)
    lp.copy_(torch.log_softmax(torch.randn_like(lp), -1))
    g.replay()
    again = build_ddtree(lp, 32)
    assert torch.equal(tree.tokens, again.tokens) and torch.equal(tree.parents, again.parents)
    assert not torch.equal(tree.tokens, eager.tokens)


@pytest.mark.parametrize("spec", [SpecConfig("dflash"), SpecConfig("ddtree", 12)])
def test_greedy_lossless_fp32_on_gpu(tiny_k25, drafter_dir, spec):
    llm = LLM(tiny_k25, drafter=drafter_dir, device="cuda", dtype=torch.float32, progress=False, max_batch=8)
    prompts = random_prompts(24, 1, 40, seed=1)
    sp = SamplingParams(max_tokens=16, stop_token_ids=[])
    ar = llm.generate(prompts, sp, SpecConfig("ar"))
    out = llm.generate(prompts, sp, spec)
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]


def test_bf16_divergence_only_at_near_ties(tiny_k25, drafter_dir):
    llm = LLM(tiny_k25, drafter=drafter_dir, device="cuda", progress=False, max_batch=8)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 600, (20,), generator=gen).tolist() for _ in range(16)]
    sp = SamplingParams(max_tokens=16, stop_token_ids=[])
    ar = llm.generate(prompts, sp, SpecConfig("ar"))
    out = llm.generate(prompts, sp, SpecConfig("ddtree", 12))
    assert_diverges_only_at_near_ties(llm, prompts, ar, out)
