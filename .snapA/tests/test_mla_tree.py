"""(c) absorbed == naive MLA, (d) a tree-masked forward == separate causal forwards of each path."""

import pytest
import torch

from k26 import LLM
from k26.model import AttnBatch
from k26.ops import tree_mask_to_words, words_to_tree_mask
from k26.spec.tree import ancestors_from_parents


def random_tree(n, gen):
    """parents[i] < i; ancestors[i, j] = j is i or an ancestor of i."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return parents, ancestors_from_parents(torch.tensor([parents]))[0]


def path_to(i, parents):
    p = []
    while i >= 0:
        p.append(i)
        i = parents[i]
    return p[::-1]


@pytest.fixture(scope="module")
def llm(tiny_k25):
    return LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False)


def test_mask_words_round_trip():
    m = torch.rand(2, 70, 70, generator=torch.Generator().manual_seed(0)) > 0.5
    assert torch.equal(words_to_tree_mask(tree_mask_to_words(m), 70), m)


def test_absorbed_equals_naive_fp32_logits(tiny_k25):
    ids = torch.randint(0, 600, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    a = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, absorb=True).score(ids)
    b = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, absorb=False).score(ids)
    assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_absorbed_equals_naive_bf16_dense_layer(tiny_k25):
    """In bf16 compare after the dense layer 0: later MoE layers amplify rounding into routing flips."""
    llm = LLM(tiny_k25, device="cpu", dtype=torch.bfloat16, progress=False)
    ids = torch.randint(0, 600, (1, 29), generator=torch.Generator().manual_seed(1))
    batch = AttnBatch.causal(torch.tensor([0]), 29)
    with torch.no_grad():
        a = llm.model(ids, batch, llm.cache.kv_LRTC, aux_layers=(0,), absorb=True)[1].float()
        b = llm.model(ids, batch, llm.cache.kv_LRTC, aux_layers=(0,), absorb=False)[1].float()
    assert ((a - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.parametrize("absorb", [True, False])
def test_tree_forward_equals_path_forwards(llm, absorb):
    gen = torch.Generator().manual_seed(2)
    V, n = llm.config.vocab_size, 12
    prompts = [torch.randint(0, V, (L,), generator=gen).tolist() for L in (9, 5)]  # two prefix lengths
    trees = [random_tree(n, gen) for _ in prompts]
    tokens = torch.randint(0, V, (2, n), generator=gen)
    with torch.no_grad():
        rows = torch.tensor([2, 3])  # not rows 0/1: the per-path score() below uses row 0
        for b, p in enumerate(prompts):
            pre = AttnBatch.causal(torch.tensor([0]), len(p), rows[b : b + 1])
            llm.model(torch.tensor([p]), pre, llm.cache.kv_LRTC, absorb=absorb)
        batch = AttnBatch.tree(
            torch.tensor([len(p) for p in prompts]), torch.stack([t[1] for t in trees]), rows
        )
        h, _ = llm.model(tokens, batch, llm.cache.kv_LRTC, absorb=absorb)
        tree_logits = llm.model.logits(h)
    for b, (parents, _) in enumerate(trees):
        for i in range(n):
            path = prompts[b] + tokens[b, path_to(i, parents)].tolist()
            ref = llm.score(path)[-1]
            assert ((tree_logits[b, i] - ref).norm() / ref.norm()).item() < 1e-5, (b, i)


def test_training_forward_equals_cached_forward(llm):
    ids = torch.randint(0, 600, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        train_h, _ = llm.model.forward_train(ids)
        h, _ = llm.model(
            ids, AttnBatch.causal(torch.zeros(2, dtype=torch.long), 13), llm.cache.kv_LRTC, absorb=False
        )
    assert ((train_h - h).norm() / h.norm()).item() < 1e-5


@pytest.mark.parametrize("static", [False, True])
def test_reference_attention_ignores_nan_in_unseen_cache_slots(static):
    """Cache slots no query sees (past the shorter row's prefix; the whole row when static) are NaN-poisoned:
    the reference attention's output and lse equal those over a zero-filled cache and are finite."""
    g = torch.Generator().manual_seed(3)
    B, N, H, C, V, L = 2, 3, 2, 24, 16, 20
    prefix = torch.tensor([4, 11])
    parents = [-1, 0, 0]
    words = tree_mask_to_words(ancestors_from_parents(torch.tensor([parents, parents])))
    q = torch.randn(B, N, H, C, generator=g)
    outs = []
    for fill in (float("nan"), 0.0):
        cache = torch.full((3, L, C), fill)
        rows = torch.tensor([2, 0])
        for b in range(B):  # the prefix and this step's tree slots are written, nothing else
            n = int(prefix[b]) + N
            cache[rows[b], :n] = torch.randn(n, C, generator=torch.Generator().manual_seed(b))
        outs.append(torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, 0.2, V, static))
    for t in outs[0]:
        assert torch.isfinite(t).all()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
