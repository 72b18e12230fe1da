"""DDTree construction on the device: the `budget` most probable prefixes under the product of the
drafter's per-depth marginals (Prop. 2 of the DDTree paper), batched, static shapes, no host sync.

Order and ties: nodes are ranked by (score desc, depth asc, rank tuple asc) — the order in which a
best-first heap pops them when ties go to the shallower node, then to the smaller rank tuple. Every
child ranks after its parent, so the top `budget` set is prefix-closed and listing it in this order
gives parents smaller indices than their children. `build_ddtree_heap` is that heap, kept as the
reference; `build_ddtree` computes the same set level by level:

  beam_d = the top-`budget` depth-d prefixes among the children of beam_{d-1}; a child (parent of
  score-rank i, token rank j) can only enter if (i+1)(j+1) <= budget, since all (i', j') <= (i, j)
  score at least as high and rank before it. The global top `budget` then lie in the union of beams.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ..ops import tree_mask_to_words, words_to_tree_mask


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
    """The constant index tensors the tree builders read, made once per shape and device and kept as long
    as this object: a CUDA graph captured over a step reads them (a capture may not copy from the host),
    so they live with whoever owns the graphs (the decoder's `DecodeContext`, via `StepModels`). A builder
    called without one makes them afresh."""

    def __init__(self) -> None:
        self._tables: dict[tuple, object] = {}

    def admissible(
        self, budget: int, K: int, width: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("admissible", budget, K, width, torch.device(device))
        if key not in self._tables:
            self._tables[key] = _admissible(budget, K, width, device)
        return self._tables[key]

    def self_words(self, first: int, nodes: int, device: torch.device) -> torch.Tensor:
        key = ("self_words", first, nodes, torch.device(device))
        if key not in self._tables:
            self._tables[key] = _self_words(first, nodes, device)
        return self._tables[key]


def _admissible(budget: int, K: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j) with (i+1)(j+1) <= budget, i < width, j < K: the only children that can enter the next beam."""
    pi, pj = [], []
    for i in range(min(budget, width)):
        for j in range(min(K, budget // (i + 1))):
            pi.append(i)
            pj.append(j)
    return torch.tensor(pi, device=device), torch.tensor(pj, device=device)


def build_ddtree(logprobs: torch.Tensor, budget: int, tables: TreeTables | None = None) -> DraftTree:
    """logprobs [B, L, V] (per-depth drafter log-probabilities) -> the optimal tree of `budget` nodes."""
    if budget < 1:
        raise ValueError(f"budget={budget}: must be >= 1")
    lp, tok = logprobs.topk(min(budget, logprobs.shape[2]), dim=-1)  # [B, L, K], sorted descending
    return build_ddtree_from_topk(lp, tok, budget, tables)


def build_ddtree_from_topk(
    lp: torch.Tensor, tok: torch.Tensor, budget: int, tables: TreeTables | None = None
) -> DraftTree:
    """The tree from per-depth top-K (log-prob, token) pairs sorted descending, K = min(budget, V).
    On CUDA one thread block per tree builds it (csrc/ddtree_build.cu); elsewhere the torch version below."""
    if lp.is_cuda and budget <= 512 and lp.shape[1] <= 15:
        from ..ops.tree_cuda import build_ddtree_cuda

        t = build_ddtree_cuda(lp, tok, budget)
        if t is not None:
            return DraftTree(*t, lp.shape[1])
    scores, toks, parents = _beams(lp.double(), tok, budget, tables or TreeTables())
    return _tree_from_beams(scores, toks, parents, budget, lp.shape[1])


def _beams(
    lp: torch.Tensor, tok: torch.Tensor, budget: int, tables: TreeTables
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per depth, the beam of the top-`budget` prefixes in lexicographic order: (scores, tokens, parent
    positions in the previous beam, -1 at depth 1), each [B, W_d]."""
    B, L, K = lp.shape
    dev = lp.device
    # Depth 1: the K candidates in rank order (which is also lexicographic order).
    beam_score = lp[:, 0, :].clone()  # [B, W]
    beam_tok = tok[:, 0, :].clone()
    beam_parent = torch.full_like(beam_tok, -1)  # lexicographic position of the parent in the previous beam
    W = min(budget, K)
    beam_score, beam_tok, beam_parent = beam_score[:, :W], beam_tok[:, :W], beam_parent[:, :W]
    scores, toks, parents = [beam_score], [beam_tok], [beam_parent]
    for d in range(1, L):
        # Score rank of each beam member (stable: ties keep lexicographic order).
        order = torch.sort(beam_score, dim=-1, descending=True, stable=True).indices  # [B, W]
        pi_t, pj_t = tables.admissible(budget, K, beam_score.shape[1], dev)
        par_lex = order[:, pi_t]  # [B, P] lexicographic position of each candidate's parent
        cand_score = beam_score.gather(1, par_lex) + lp[:, d, :].gather(1, pj_t.expand(B, -1))
        cand_lex = par_lex * K + pj_t  # lexicographic key of the candidate
        # Top-W by (score desc, lex asc): sort by lex, then a stable sort by score.
        by_lex = torch.sort(cand_lex, dim=-1, stable=True).indices
        cand_score, cand_lex, par_lex = (t.gather(1, by_lex) for t in (cand_score, cand_lex, par_lex))
        cand_j = cand_lex % K
        W = min(budget, cand_score.shape[1])
        top = torch.sort(cand_score, dim=-1, descending=True, stable=True).indices[:, :W]
        top = torch.sort(top, dim=-1).values  # back to lexicographic order for the next depth
        beam_score = cand_score.gather(1, top)
        beam_parent = par_lex.gather(1, top)
        beam_tok = tok[:, d, :].gather(1, cand_j.gather(1, top))
        scores.append(beam_score)
        toks.append(beam_tok)
        parents.append(beam_parent)
    return scores, toks, parents


def _tree_from_beams(
    scores: list[torch.Tensor], toks: list[torch.Tensor], parents: list[torch.Tensor], budget: int, L: int
) -> DraftTree:
    """The union of the beams in (depth, lex) order, its global top `budget` by a stable score sort in pop
    order, padded with invalid nodes to `budget`."""
    B, dev = scores[0].shape[0], scores[0].device
    sizes = [s.shape[1] for s in scores]
    all_score = torch.cat(scores, dim=1)
    all_depth = torch.cat([torch.full((B, n), d + 1, device=dev) for d, n in enumerate(sizes)], dim=1)
    offsets = [sum(sizes[:d]) for d in range(len(sizes))]
    all_parent = torch.cat(
        [torch.where(p >= 0, p + (offsets[d - 1] if d else 0), -1) for d, p in enumerate(parents)], dim=1
    )  # index of the parent within the union, -1 for depth 1
    all_tok = torch.cat(toks, dim=1)
    n = min(budget, all_score.shape[1])
    pick = torch.sort(all_score, dim=-1, descending=True, stable=True).indices[:, :n]  # pop order
    # Position in pop order of every union member (or -1): parents become node indices.
    where = torch.full_like(all_score, -1, dtype=torch.long).scatter_(
        1, pick, torch.arange(n, device=dev).expand(B, n)
    )
    node_parent_union = all_parent.gather(1, pick)
    node_parent = torch.where(node_parent_union >= 0, where.gather(1, node_parent_union.clamp_min(0)) + 1, 0)
    node_score = all_score.gather(1, pick)
    valid = torch.isfinite(node_score)
    pad = budget - n
    root = torch.zeros(B, 1, dtype=torch.long, device=dev)
    tokens = torch.cat([root, all_tok.gather(1, pick), root.expand(B, pad)], 1)
    parents_t = torch.cat([root - 1, node_parent, root.expand(B, pad)], 1)
    depths = torch.cat([root, all_depth.gather(1, pick), root.expand(B, pad) + 1], 1)
    valid_t = torch.cat(
        [torch.ones_like(root, dtype=torch.bool), valid, torch.zeros(B, pad, dtype=torch.bool, device=dev)], 1
    )
    parents_t = torch.where(valid_t | (parents_t < 0), parents_t, 0)
    score_t = torch.cat(
        [
            torch.zeros(B, 1, dtype=torch.float64, device=dev),
            node_score,
            torch.full((B, pad), float("-inf"), dtype=torch.float64, device=dev),
        ],
        1,
    )
    return DraftTree(
        tokens,
        parents_t,
        depths,
        valid_t,
        tree_mask_to_words(ancestors_from_parents(parents_t, valid_t, L)),
        score_t,
        L,
    )


def ancestors_from_parents(
    parents: torch.Tensor, valid: torch.Tensor | None = None, max_depth: int | None = None
) -> torch.Tensor:
    """[B, N, N] ancestor-or-self mask of parents [B, N] (root -1, parents[i] < i) by walking every node up
    `max_depth` steps at once (default N - 1: any tree); invalid (padding) nodes see only themselves."""
    B, N = parents.shape
    valid = torch.ones_like(parents, dtype=torch.bool) if valid is None else valid
    max_depth = N - 1 if max_depth is None else max_depth
    anc = torch.zeros(B, N, N, dtype=torch.bool, device=parents.device)
    cur = torch.arange(N, device=parents.device).expand(B, N).clone()
    for _ in range(max_depth + 1):
        anc.scatter_(2, cur.unsqueeze(-1), True)
        cur = parents.gather(1, cur).clamp_min(0)
    # Padding nodes see only themselves (their row must still hold a key for attention to be defined).
    eye = torch.eye(N, dtype=torch.bool, device=parents.device)
    return torch.where(valid[:, :, None], anc, eye)


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
