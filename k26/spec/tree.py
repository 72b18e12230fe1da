"""DDTree trees: `DraftTree` (what a step verifies), `build_ddtree` — the `budget` most probable prefixes
under the product of the drafter's per-depth marginals (Prop. 2 of the DDTree paper), batched, static
shapes, no host sync — through the op `torch.ops.k26.ddtree_build` (the level-by-level reference in
k26/ops/reference_tree.py is its specification, csrc/ddtree_build.cu its CUDA kernel); `build_ddtree_heap`,
the best-first heap both must equal (the oracle); the DFlash chain; bucket padding.

Order and ties: nodes are ranked by (score desc, depth asc, rank tuple asc) — the order in which a
best-first heap pops them when ties go to the shallower node, then to the smaller rank tuple. Every
child ranks after its parent, so the top `budget` set is prefix-closed and listing it in this order
gives parents smaller indices than their children.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ..ops import tree_mask_to_words, words_to_tree_mask
from ..ops.reference_tree import ancestors_from_parents  # noqa: F401  (re-exported: tests, benches)


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, 1 + n] int64; index 0 is the root (the caller writes the bonus token)
    parents: torch.Tensor  # [B, 1 + n] int64; root -1, parents[i] < i
    depths: torch.Tensor  # [B, 1 + n] int64; root 0
    valid: torch.Tensor  # [B, 1 + n] bool; False for padding nodes (never visible, never accepted)
    words: (
        torch.Tensor
    )  # [B, 1 + n, ceil((1 + n) / 64)] int64 ancestor-or-self bitmask (tree attention's mask)
    scores: torch.Tensor  # [B, 1 + n] float64 log q(u); root 0
    max_depth: int  # static: the drafter's L = block - 1, the longest path the walk may take

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def ancestors(self) -> torch.Tensor:
        """[B, 1 + n, 1 + n] bool: j is i or an ancestor of i."""
        return words_to_tree_mask(self.words, self.num_nodes)

    def mask_words(self) -> torch.Tensor:
        return self.words


class TreeTables:
    """The constant index tensors of bucket padding (`pad_tree`), made once per shape and device and kept
    as long as this object: a CUDA graph captured over a step reads them (a capture may not copy from the
    host), so they live with whoever owns the graphs (the decoder's `DecodeContext`, via `StepModels`). A
    caller without one makes them afresh."""

    def __init__(self) -> None:
        self._tables: dict[tuple, torch.Tensor] = {}

    def self_words(self, first: int, nodes: int, device: torch.device) -> torch.Tensor:
        key = ("self_words", first, nodes, torch.device(device))
        if key not in self._tables:
            self._tables[key] = _self_words(first, nodes, device)
        return self._tables[key]


def build_ddtree(logprobs: torch.Tensor, budget: int) -> DraftTree:
    """logprobs [B, L, V] (per-depth drafter log-probabilities) -> the optimal tree of `budget` nodes."""
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget={budget!r}: must be an integer >= 1")
    lp, tok = logprobs.topk(min(budget, logprobs.shape[2]), dim=-1)  # [B, L, K], sorted descending
    return build_ddtree_from_topk(lp, tok, budget)


def build_ddtree_from_topk(lp: torch.Tensor, tok: torch.Tensor, budget: int) -> DraftTree:
    """The tree from per-depth top-K (log-prob, token) pairs sorted descending, K = min(budget, V)."""
    return DraftTree(*torch.ops.k26.ddtree_build(lp, tok, budget), lp.shape[1])


def chain_tree(logprobs: torch.Tensor) -> DraftTree:
    """The DFlash chain: the top-1 token at every depth (the top-1 special case of the tree)."""
    lp, tok = logprobs.max(dim=-1)
    return chain_from_topk(lp[..., None], tok[..., None])


def chain_from_topk(lp: torch.Tensor, tok: torch.Tensor) -> DraftTree:
    """The chain from per-depth top-K (log-prob, token) pairs sorted descending (only rank 0 is used)."""
    lp, tok = lp[..., 0], tok[..., 0]
    B, L = lp.shape
    dev = lp.device
    root = torch.zeros(B, 1, dtype=torch.long, device=dev)
    ar = torch.arange(L + 1, device=dev)
    parents = (ar - 1).expand(B, L + 1).clone()
    anc = torch.ones(L + 1, L + 1, dtype=torch.bool, device=dev).tril().expand(B, -1, -1)
    scores = torch.cat([root.double(), lp.double().cumsum(-1)], 1)
    return DraftTree(
        torch.cat([root, tok], 1),
        parents,
        ar.expand(B, -1).clone(),
        torch.ones(B, L + 1, dtype=torch.bool, device=dev),
        tree_mask_to_words(anc),
        scores,
        L,
    )


def build_ddtree_heap(logprobs: torch.Tensor, budget: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Reference best-first heap, one tree per batch row: (tokens, parents, depths) incl. the root."""
    out = []
    B, L, V = logprobs.shape
    K = min(budget, V)
    lp_all, tok_all = logprobs.topk(K, dim=-1)
    for b in range(B):
        lp, tok = lp_all[b].double().tolist(), tok_all[b].tolist()
        # key: (-score, depth, ranks); entries carry (parent node, parent score)
        heap = [(-lp[0][0], 1, (0,), 0, 0.0)]
        tokens, parents, depths = [0], [-1], [0]
        while heap and len(tokens) - 1 < budget:
            neg, d, ranks, par, par_score = heapq.heappop(heap)
            if neg == float("inf"):
                break
            node = len(tokens)
            r = ranks[-1]
            tokens.append(tok[d - 1][r])
            parents.append(par)
            depths.append(d)
            if r + 1 < K:  # next sibling: the parent's score plus the next rank's log-prob
                heapq.heappush(
                    heap, (-(par_score + lp[d - 1][r + 1]), d, ranks[:-1] + (r + 1,), par, par_score)
                )
            if d < L:  # first child
                heapq.heappush(heap, (-(-neg + lp[d][0]), d + 1, ranks + (0,), node, -neg))
        out.append((tokens, parents, depths))
    return out


def pad_tree(tree: DraftTree, nodes: int, tables: TreeTables | None = None) -> DraftTree:
    """Pad to a bucket's node count: padding nodes see only themselves and are never accepted."""
    extra = nodes - tree.num_nodes
    if extra < 0:
        raise ValueError(f"tree of {tree.num_nodes} nodes does not fit a bucket of {nodes}")
    if extra == 0:
        return tree
    B, N0, W0 = tree.words.shape
    dev = tree.tokens.device
    W = (nodes + 63) // 64
    words = torch.zeros(B, nodes, W, dtype=torch.int64, device=dev)
    words[:, :N0, :W0] = tree.words
    words[:, N0:] = (tables or TreeTables()).self_words(N0, nodes, dev)
    z = torch.zeros(B, extra, dtype=torch.long, device=dev)
    return DraftTree(
        torch.cat([tree.tokens, z], 1),
        torch.cat([tree.parents, z], 1),
        torch.cat([tree.depths, z + 1], 1),
        torch.cat([tree.valid, z.bool()], 1),
        words,
        torch.cat([tree.scores, torch.full((B, extra), float("-inf"), dtype=torch.float64, device=dev)], 1),
        tree.max_depth,
    )


def _self_words(first: int, nodes: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(first, nodes)
    eye = torch.zeros(nodes - first, nodes, dtype=torch.bool)
    eye[torch.arange(nodes - first), idx] = True
    return tree_mask_to_words(eye[None])[0].to(device)
