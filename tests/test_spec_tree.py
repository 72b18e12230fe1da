"""DDTree's pieces on the CPU: the tree builder == the best-first heap oracle (scores, visibility, padding,
the DFlash chain), the acceptance walk (sampling matches autoregressive sampling, greedy follows the argmax)
and the latent KV commit."""

import pytest
import torch

from k26 import SamplingParams
from k26.sampling import RowSampling, sample_rows
from k26.spec.accept import accept_walk, commit_latent
from k26.spec.tree import build_ddtree, build_ddtree_heap, chain_tree, pad_tree


# -- tree ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 2, 5, 16, 63, 128, 512])
@pytest.mark.parametrize("depth", [1, 3, 7, 15])
def test_tree_is_the_heap_tree(budget, depth):
    lp = torch.log_softmax(
        torch.randn(3, depth, 700, generator=torch.Generator().manual_seed(budget + depth)) * 3, -1
    )
    tree = build_ddtree(lp, budget)
    for b, (tok, par, dep) in enumerate(build_ddtree_heap(lp, budget)):
        n = len(tok)
        assert tree.tokens[b, 1:n].tolist() == tok[1:]
        assert tree.parents[b, :n].tolist() == par and tree.depths[b, :n].tolist() == dep
        assert tree.valid[b, :n].all() and not tree.valid[b, n:].any()


def test_tree_pads_when_fewer_prefixes_than_budget():
    lp = torch.log_softmax(torch.randn(1, 2, 3), -1)  # 3 + 9 = 12 prefixes
    tree = build_ddtree(lp, 20)
    assert tree.num_nodes == 21 and int(tree.valid.sum()) == 13
    assert not tree.ancestors[0, 13:, 0].any()  # padding never sees the root


@pytest.mark.parametrize("budget, nodes", [(12, 16), (5, 64), (40, 64), (60, 70), (3, 130)])
def test_a_tree_padded_into_a_bucket_keeps_its_nodes_and_its_padding_sees_only_itself(budget, nodes):
    # (pad_tree failed for every tree of one node or more: the padding rows' words came from a square-mask
    # conversion; found by the GPU test of a fixed budget in a larger user bucket)
    lp = torch.log_softmax(torch.randn(2, 4, 50), -1)
    tree = build_ddtree(lp, budget)
    n0 = tree.num_nodes
    padded = pad_tree(tree, nodes)
    assert padded.num_nodes == nodes and padded.words.shape == (2, nodes, (nodes + 63) // 64)
    want = torch.zeros(2, nodes, nodes, dtype=torch.bool)
    want[:, :n0, :n0] = tree.ancestors
    want[:, n0:, n0:] = torch.eye(nodes - n0, dtype=torch.bool)
    assert torch.equal(padded.ancestors, want)
    assert torch.equal(padded.tokens[:, :n0], tree.tokens) and not padded.valid[:, n0:].any()


def test_tree_scores_and_visibility():
    # peaked log-probs: the tree reaches the last depth (with flat ones it stopped at 1-2 of 4, and a node at
    # the deepest level never had its visibility checked)
    g = torch.Generator().manual_seed(5)
    lp = torch.log_softmax(torch.randn(2, 4, 50, generator=g) * 4, -1)
    tree = build_ddtree(lp, 24)
    assert tree.depths.amax(-1).tolist() == [4, 4]
    for b in range(2):
        assert tree.ancestors[b, 0].tolist() == [True] + [False] * 24  # the root sees itself only
        for i in range(1, 25):
            p = int(tree.parents[b, i])
            assert p < i and tree.depths[b, i] == tree.depths[b, p] + 1
            want = tree.ancestors[b, p].clone()
            want[i] = True
            assert torch.equal(tree.ancestors[b, i], want)
        assert (tree.scores[b, 1:].diff() <= 0).all()  # pop order is score order


def test_chain_is_top1_tree():
    lp = torch.log_softmax(torch.randn(2, 7, 30), -1)
    chain, tree = chain_tree(lp), build_ddtree(lp, 7)
    top1 = lp.argmax(-1)
    assert torch.equal(chain.tokens[:, 1:], top1) and chain.parents[0].tolist() == list(range(-1, 7))
    assert set(tree.tokens[0, 1:].tolist()) >= {int(top1[0, 0])}
    # each node sees the root and every node above it (causal), at its own depth, scored by its path's sum
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(chain.ancestors, causal.expand(2, -1, -1))
    assert chain.depths[0].tolist() == list(range(8))
    path = torch.cat([torch.zeros(2, 1, dtype=torch.float64), lp.amax(-1).double().cumsum(-1)], 1)
    assert torch.allclose(chain.scores.double(), path)


# -- acceptance ---------------------------------------------------------------------------------
def test_sampling_walk_matches_autoregressive_distribution():
    """V = 4, depth 2: the first two tokens of (walk + next step) vs direct AR sampling, chi-square."""
    g = torch.Generator().manual_seed(0)
    V, n = 4, 40000
    p1 = torch.softmax(torch.randn(V, generator=g), -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # p2[x1] = p(x2 | x1)
    lp = torch.log_softmax(torch.randn(1, 2, V, generator=g), -1).expand(n, -1, -1)
    tree = build_ddtree(lp, 5)
    # node logits: root -> p1, node u (depth 1, token x) -> p2[x], depth-2 nodes arbitrary
    logits = torch.randn(n, tree.num_nodes, V, generator=g)
    logits[:, 0] = p1.log()
    for i in range(1, tree.num_nodes):
        if tree.depths[0, i] == 1:
            logits[:, i] = p2[tree.tokens[0, i]].log()
    noise = torch.empty(n, tree.num_nodes, V).exponential_(1.0, generator=g)
    choice = sample_rows(logits, RowSampling.of([SamplingParams(temperature=1.0)] * n, "cpu", noise))
    path, n_acc, bonus = accept_walk(tree, choice)
    first = torch.where(n_acc >= 1, tree.tokens.gather(1, path[:, 1:2].clamp_min(0))[:, 0], bonus)
    second_in_step = torch.where(n_acc >= 2, tree.tokens.gather(1, path[:, 2:3].clamp_min(0))[:, 0], bonus)
    nxt = torch.multinomial(p2[first], 1, generator=g)[:, 0]  # what the next step would sample
    second = torch.where(n_acc >= 1, second_in_step, nxt)
    got = torch.bincount(first * V + second, minlength=V * V).float()
    want = (p1[:, None] * p2).flatten() * n
    chi2 = ((got - want) ** 2 / want).sum().item()
    assert chi2 < 37.7, chi2  # df = 15, p = 0.001


def test_greedy_walk_follows_argmax():
    lp = torch.log_softmax(torch.randn(1, 3, 10, generator=torch.Generator().manual_seed(4)), -1)
    tree = build_ddtree(lp, 6)
    logits = torch.full((1, 7, 10), -5.0)
    # the target agrees with node 1's token at the root, then picks a token none of node 1's children carry
    logits[0, 0, tree.tokens[0, 1]] = 5.0
    children = set(tree.tokens[0][tree.parents[0] == 1].tolist())
    logits[0, 1, next(t for t in range(10) if t not in children)] = 5.0
    path, n_acc, bonus = accept_walk(tree, sample_rows(logits, RowSampling.of([SamplingParams()], "cpu")))
    assert path[0, :2].tolist() == [0, 1] and int(n_acc) == 1
    assert int(bonus) == int(logits[0, 1].argmax())


def test_commit_moves_accepted_rows():
    cache = torch.randn(2, 3, 20, 5)
    before = cache.clone()
    start, rows = torch.tensor([4, 7]), torch.tensor([2, 0])
    path = torch.tensor([[0, 2, 5, -1], [0, 1, 2, 3]])
    commit_latent(cache, rows, start, path.clamp_min(0))
    assert torch.equal(cache[:, 2, 4:7], before[:, 2, [4, 6, 9]])
    assert torch.equal(cache[:, 0, 7:11], before[:, 0, 7:11])
    assert torch.equal(cache[:, 1], before[:, 1])
