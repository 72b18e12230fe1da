"""Pure-torch reference of `torch.ops.k26.ddtree_build` (the DDTree builder): its specification, as
k26/ops/reference.py is for the other ops."""

from __future__ import annotations

import torch

from .reference import tree_mask_to_words

# ---------------------------------------------------------------- DDTree builder (torch.ops.k26.ddtree_build)
#
# The `budget` most probable prefixes under the product of the drafter's per-depth marginals (Prop. 2 of
# the DDTree paper), level by level. Nodes are ranked by (score desc, depth asc, rank tuple asc): the order
# in which a best-first heap pops them when ties go to the shallower node, then to the smaller rank tuple
# (`k26.spec.tree.build_ddtree_heap`, the oracle). Every child ranks after its parent, so the top `budget`
# set is prefix-closed and listing it in this order gives parents smaller indices than their children.
#
#   beam_d = the top-`budget` depth-d prefixes among the children of beam_{d-1}; a child (parent of
#   score-rank i, token rank j) can only enter if (i+1)(j+1) <= budget, since all (i', j') <= (i, j)
#   score at least as high and rank before it. The global top `budget` then lie in the union of beams.


def ddtree_build(lp_BLK: torch.Tensor, tok_BLK: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
    """Per-depth top-K (log-prob, token) pairs [B, L, K], sorted descending -> the tree of `budget` nodes
    plus the root, in pop order, padded with invalid nodes: (tokens, parents, depths) [B, 1 + budget]
    int64 (root token 0, parent -1, depth 0), valid [B, 1 + budget] bool, the ancestor-or-self words
    [B, 1 + budget, ceil((1 + budget) / 64)] int64 and the scores [B, 1 + budget] float64 (root 0)."""
    scores, toks, parents = _beams(lp_BLK.double(), tok_BLK.long(), budget)
    return _tree_from_beams(scores, toks, parents, budget, lp_BLK.shape[1])


def _admissible(budget: int, K: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j) with (i+1)(j+1) <= budget, i < width, j < K, i-major: the only children that can enter the
    next beam. Made on the device from the shape alone (no host table: graph-capturable, stateless)."""
    n = min(budget, width)
    P = sum(min(K, budget // (i + 1)) for i in range(n))
    counts = (budget // torch.arange(1, n + 1, device=device)).clamp(max=K)
    ends = counts.cumsum(0)  # candidate c belongs to the first parent whose end exceeds it
    c = torch.arange(P, device=device)
    pi = torch.searchsorted(ends, c, right=True)  # (not repeat_interleave: one parent reads it on the host)
    return pi, c - (ends - counts)[pi]


def _beams(lp: torch.Tensor, tok: torch.Tensor, budget: int) -> tuple[list, list, list]:
    """Per depth, the beam of the top-`budget` prefixes in lexicographic order: (scores, tokens, parent
    positions in the previous beam, -1 at depth 1), each [B, W_d]."""
    B, L, K = lp.shape
    W = min(budget, K)
    # Depth 1: the K candidates in rank order (which is also lexicographic order).
    beam_score, beam_tok = lp[:, 0, :W].clone(), tok[:, 0, :W].clone()
    scores, toks, parents = [beam_score], [beam_tok], [torch.full_like(beam_tok, -1)]
    admissible = {}  # per beam width: after the first depths every beam is `budget` wide
    for d in range(1, L):
        # Score rank of each beam member (stable: ties keep lexicographic order).
        order = torch.sort(beam_score, dim=-1, descending=True, stable=True).indices  # [B, W]
        if beam_score.shape[1] not in admissible:
            admissible[beam_score.shape[1]] = _admissible(budget, K, beam_score.shape[1], lp.device)
        pi, pj = admissible[beam_score.shape[1]]
        par_lex = order[:, pi]  # [B, P] lexicographic position of each candidate's parent
        cand_score = beam_score.gather(1, par_lex) + lp[:, d, :].gather(1, pj.expand(B, -1))
        cand_lex = par_lex * K + pj  # lexicographic key of the candidate
        # Top-W by (score desc, lex asc): sort by lex, then a stable sort by score.
        by_lex = torch.sort(cand_lex, dim=-1, stable=True).indices
        cand_score, cand_lex, par_lex = (t.gather(1, by_lex) for t in (cand_score, cand_lex, par_lex))
        W = min(budget, cand_score.shape[1])
        top = torch.sort(cand_score, dim=-1, descending=True, stable=True).indices[:, :W]
        top = torch.sort(top, dim=-1).values  # back to lexicographic order for the next depth
        beam_score = cand_score.gather(1, top)
        scores.append(beam_score)
        toks.append(tok[:, d, :].gather(1, (cand_lex % K).gather(1, top)))
        parents.append(par_lex.gather(1, top))
    return scores, toks, parents


def _tree_from_beams(
    scores: list, toks: list, parents: list, budget: int, L: int
) -> tuple[torch.Tensor, ...]:
    """The union of the beams in (depth, lex) order, its global top `budget` by a stable score sort in pop
    order, padded with invalid nodes to `budget`."""
    B, dev = scores[0].shape[0], scores[0].device
    sizes = [s.shape[1] for s in scores]
    offsets = [sum(sizes[:d]) for d in range(len(sizes))]
    all_score, all_tok = torch.cat(scores, dim=1), torch.cat(toks, dim=1)
    all_depth = torch.cat([torch.full((B, n), d + 1, device=dev) for d, n in enumerate(sizes)], dim=1)
    all_parent = torch.cat(
        [torch.where(p >= 0, p + (offsets[d - 1] if d else 0), -1) for d, p in enumerate(parents)], dim=1
    )  # index of the parent within the union, -1 for depth 1
    n = min(budget, all_score.shape[1])
    pick = torch.sort(all_score, dim=-1, descending=True, stable=True).indices[:, :n]  # pop order
    # Position in pop order of every union member (or -1): parents become node indices.
    where = torch.full_like(all_score, -1, dtype=torch.long).scatter_(
        1, pick, torch.arange(n, device=dev).expand(B, n)
    )
    node_parent_union = all_parent.gather(1, pick)
    node_parent = torch.where(node_parent_union >= 0, where.gather(1, node_parent_union.clamp_min(0)) + 1, 0)
    node_score = all_score.gather(1, pick)
    pad = budget - n
    root = torch.zeros(B, 1, dtype=torch.long, device=dev)
    tokens = torch.cat([root, all_tok.gather(1, pick), root.expand(B, pad)], 1)
    parents_t = torch.cat([root - 1, node_parent, root.expand(B, pad)], 1)
    depths = torch.cat([root, all_depth.gather(1, pick), root.expand(B, pad) + 1], 1)
    yes, no = torch.ones_like(root, dtype=torch.bool), torch.zeros(B, pad, dtype=torch.bool, device=dev)
    valid = torch.cat([yes, torch.isfinite(node_score), no], 1)
    parents_t = torch.where(valid | (parents_t < 0), parents_t, 0)
    f64 = {"dtype": torch.float64, "device": dev}
    score_t = torch.cat([torch.zeros(B, 1, **f64), node_score, torch.full((B, pad), float("-inf"), **f64)], 1)
    words = tree_mask_to_words(ancestors_from_parents(parents_t, valid, L))
    return tokens, parents_t, depths, valid, words, score_t


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
