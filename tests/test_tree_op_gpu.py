"""torch.ops.k26.ddtree_build on the device: the CUDA kernel equals the pure-torch reference (fresh random
inputs, outputs over poisoned memory), the reference path the front door takes for trees deeper than the
kernel holds is graph-capturable, and the kernel's scratch is planned once per shape."""

import pytest
import torch

from k26.ops import reference_tree, tree_cuda

pytestmark = pytest.mark.gpu


def topk_inputs(B, L, V, budget, seed, k=None):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(B, L, V, generator=g) * 3, -1)
    top = lp.topk(k or min(budget, V), dim=-1)
    return top.values.cuda(), top.indices.cuda()


def poison_allocator() -> None:
    """Fill the caching allocator's free blocks with garbage, so outputs the op leaves unwritten show."""
    junk = torch.full((64 << 20,), -1, dtype=torch.int8, device="cuda")
    del junk


@pytest.mark.parametrize(
    "B, L, V, budget, k",
    # beams in shared memory up to 64 KB (budget 128 at depth 15), the global scratch above (160, 255);
    # k: a top-k wider than the budget (only j < budget can be admissible, the rest is never read)
    [
        (3, 7, 3000, 31, None),
        (2, 7, 5000, 64, None),
        (1, 15, 2000, 128, None),
        (1, 15, 2000, 160, None),
        (2, 15, 500, 255, None),
        (4, 3, 6, 40, None),
        (1, 1, 9, 1, None),
        (2, 7, 3000, 16, 40),
        (1, 15, 2000, 64, 100),
        (2, 3, 500, 5, 9),
    ],
)
def test_kernel_equals_reference(B, L, V, budget, k):
    lp, tok = topk_inputs(B, L, V, budget, seed=budget + L, k=k)
    assert_op_equals_reference(lp, tok, budget)


def tied_inputs(B, L, V, k, seed, steps):
    """Log-probabilities on a grid of `steps` values (0, -0.25, ...: exact ties and -0.0 everywhere)."""
    g = torch.Generator().manual_seed(seed)
    lp = -(torch.randint(0, steps, (B, L, V), generator=g).float() / 4)
    top = lp.topk(k, dim=-1)
    return top.values.cuda(), top.indices.cuda()


def assert_op_equals_reference(lp, tok, budget):
    want = reference_tree.ddtree_build(lp.cpu(), tok.cpu(), budget)
    poison_allocator()
    got = torch.ops.k26.ddtree_build(lp, tok, budget)
    torch.cuda.synchronize()
    for name, g, w in zip(("tokens", "parents", "depths", "valid", "words", "scores"), got, want):
        assert torch.equal(g.cpu(), w), name
    assert torch.equal(got[5].cpu().view(torch.int64), want[5].view(torch.int64)), "score bits (-0.0)"


# Budgets <= 64 take the warp heap (csrc/ddtree_heap.cuh): every depth 1..15, budgets 1..64, top-k narrower
# and wider than the budget, exact ties on a grid (depth and rank tuple decide), non-finite log-probabilities
# (the level-by-level path instead), and trees with fewer nodes than the budget (k^1 + .. + k^L < budget: the
# heap runs dry: its empty entries must not be popped).
@pytest.mark.parametrize(
    "L, budget, V, k",
    [
        (1, 1, 5, 1),
        (1, 8, 5, 4),
        (2, 16, 3, 2),
        (2, 40, 9, 5),
        (3, 64, 9, 3),
        (2, 7, 3, 3),
        (4, 16, 9, 9),
        (7, 15, 3000, 15),
        (7, 32, 50, 32),
        (9, 48, 400, 60),
        (11, 64, 2, 2),
        (15, 16, 3000, 16),
        (15, 64, 400, 64),
        (15, 63, 100, 70),
    ],
)
def test_small_budget_trees_equal_the_reference_with_ties_and_without(L, budget, V, k):
    lp, tok = topk_inputs(3, L, V, budget, seed=budget * 31 + L, k=k)
    assert_op_equals_reference(lp, tok, budget)
    for steps in (2, 6):
        lp, tok = tied_inputs(3, L, V, k, seed=budget + steps, steps=steps)
        assert_op_equals_reference(lp, tok, budget)
    lp = lp.clone()
    lp[1, L - 1, k // 2 :] = float("-inf")  # one tree with -inf entries: the level-by-level path
    assert_op_equals_reference(lp, tok, budget)


def frontier_sizes(tok, want, budget):
    """The best-first search's frontier size after each pop, from the reference's tree: a pop removes one
    entry and pushes the node's next sibling (rank + 1 < min(K, budget)) and its first child (depth < L)."""
    L, K = tok.shape[1], min(tok.shape[2], budget)
    tokens, _, depths = (x[0].tolist() for x in want[:3])
    sizes, size = [], 1
    for node in range(1, budget + 1):
        d = depths[node]
        rank = tok[0, d - 1].tolist().index(tokens[node])
        size += (rank + 1 < K) + (d < L) - 1
        sizes.append(size)
    return sizes


# The heap keeps the frontier's best 32 entries (one a lane): an entry falls off only when it can no longer be
# popped (csrc/ddtree_heap.cuh). Near-flat log-probabilities (every depth-1 node before any depth-2 one) and
# all-equal ones (-0.0 everywhere: depth and rank tuple decide) grow the frontier past the warp at budget 64.
@pytest.mark.parametrize("flat", ["near", "tied"])
def test_a_frontier_wider_than_the_warp_gives_the_references_tree(flat):
    L, V, budget = 15, 500, 64
    if flat == "near":
        g = torch.Generator().manual_seed(5)
        top = torch.log_softmax(torch.randn(1, L, V, generator=g) * 0.01, -1).topk(budget, dim=-1)
        lp, tok = top.values.cuda(), top.indices.cuda()
    else:
        lp, tok = tied_inputs(1, L, V, budget, seed=3, steps=1)
    want = reference_tree.ddtree_build(lp.cpu(), tok.cpu(), budget)
    assert max(frontier_sizes(tok.cpu(), want, budget)) > 32  # the case this test is for
    assert_op_equals_reference(lp, tok, budget)


# (L, V, top-k, budget, finite tokens a depth): fewer finite prefixes than the budget, so the tree's tail is
# -inf (invalid, parent 0, seeing only itself; the level-by-level kernel marked such nodes valid with their
# real parents before) — budget 16 (the heap's fallback), beams in shared memory, beams in the global scratch
# (depth 15 at 160), log-probabilities left in global memory (top-2000 at 128), the bitonic sort (512).
@pytest.mark.parametrize(
    "L, V, k, budget, finite",
    [
        (3, 9, 9, 16, 2),
        (3, 9, 9, 100, 2),
        (3, 9, 9, 160, 2),
        (15, 9, 9, 160, 1),
        (15, 3000, 2000, 128, 1),
        (3, 600, 64, 512, 3),
    ],
)
def test_non_finite_log_probs_give_the_references_invalid_nodes(L, V, k, budget, finite):
    lp, tok = topk_inputs(2, L, V, budget, seed=budget + L, k=k)
    lp = lp.clone()
    lp[..., finite:] = float("-inf")
    assert_op_equals_reference(lp, tok, budget)


@pytest.mark.parametrize("budget", [1, 24])  # budget 1: one parent, one candidate per depth
def test_deep_tree_runs_the_reference_inside_a_graph(budget):
    L = tree_cuda.MAX_DEPTH + 2  # deeper than the kernel's beams: the front door runs the reference
    lp, tok = topk_inputs(2, L, 400, budget, seed=7)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.k26.ddtree_build(lp, tok, budget)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.k26.ddtree_build(lp, tok, budget)
    fresh = topk_inputs(2, L, 400, budget, seed=8)
    lp.copy_(fresh[0]), tok.copy_(fresh[1])
    g.replay()
    want = reference_tree.ddtree_build(lp.cpu(), tok.cpu(), budget)
    assert all(torch.equal(o.cpu(), w) for o, w in zip(out, want))


def test_scratch_is_planned_once_per_shape():
    lp, tok = topk_inputs(2, 7, 1000, 63, seed=3)
    torch.ops.k26.ddtree_build(lp, tok, 63)
    key = (lp.device, 2, 7, 63)
    first = tree_cuda.PLANS._scratch[key].data_ptr()
    for _ in range(3):
        torch.ops.k26.ddtree_build(lp, tok, 63)
    assert tree_cuda.PLANS._scratch[key].data_ptr() == first
