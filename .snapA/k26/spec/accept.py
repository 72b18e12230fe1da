"""Lossless acceptance and KV commit, on the device.

The target picks one token at every tree node (argmax, or an independent sample from its filtered
distribution: `sampling.sample_rows`); the walk starts at the root and moves to the child carrying the
target's token while one exists. Because each node's logits are exactly p(. | prefix, path to it),
every emitted token is the target's own choice given the true prefix: greedy output is identical to
autoregressive decoding and sampled output has the same distribution.
"""

from __future__ import annotations

import functools

import torch

from ..compiling import compile_static
from .tree import DraftTree


def accept_walk(tree: DraftTree, choice_BN: torch.Tensor):
    """Returns (path [B, 1 + max_depth] node indices, root first, -1 past the end; accepted drafts [B];
    the new bonus token [B]). Fixed number of steps, no host sync."""
    B = choice_BN.shape[0]
    u = torch.zeros(B, dtype=torch.long, device=choice_BN.device)
    alive = torch.ones(B, dtype=torch.bool, device=choice_BN.device)
    path = [u]
    for _ in range(tree.max_depth):
        want = choice_BN.gather(1, u[:, None])
        match = (tree.parents == u[:, None]) & (tree.tokens == want) & tree.valid
        found = match.any(dim=1) & alive
        u = torch.where(found, match.int().argmax(dim=1), u)
        alive = found
        path.append(torch.where(found, u, -1))
    path_BJ = torch.stack(path, dim=1)
    return path_BJ, (path_BJ[:, 1:] >= 0).sum(dim=1), choice_BN.gather(1, u[:, None])[:, 0]


def commit_latent(
    cache_LRTC: torch.Tensor, rows_B: torch.Tensor, start_B: torch.Tensor, path_BJ: torch.Tensor
) -> None:
    """Move the accepted nodes' latent rows (written at start + node) to start + 0, 1, ... .

    Gather first, then scatter: an in-place parallel copy could race since path[j] >= j. Entries past
    the accepted length copy the root onto slots beyond the committed prefix, which is harmless; the
    copy is a fixed few rows per layer so it stays static for graph capture.
    """
    J = path_BJ.shape[1]
    src = start_B[:, None] + path_BJ.clamp_min(0)
    dst = start_B[:, None] + torch.arange(J, device=path_BJ.device)
    r = rows_B[:, None].expand(-1, J)
    cache_LRTC[:, r, dst] = cache_LRTC[:, r, src].clone()


def emitted_tokens(tree: DraftTree, path_BJ: torch.Tensor, bonus_B: torch.Tensor) -> torch.Tensor:
    """[B, max_depth + 1]: the accepted drafts then the new bonus, -1 after (per row)."""
    drafts = torch.where(path_BJ[:, 1:] >= 0, tree.tokens.gather(1, path_BJ[:, 1:].clamp_min(0)), -1)
    n = (drafts >= 0).sum(dim=1, keepdim=True)
    out = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], dim=1)
    return out.scatter(1, n, bonus_B[:, None])


def accept_paths(tree: DraftTree, choice_BN: torch.Tensor, alive_B: torch.Tensor):
    """The step's acceptance: (path [B, 1 + max_depth], -1 past the end and for finished rows (frozen:
    nothing of theirs is committed); accepted drafts [B]; the new bonus [B]; the emitted tokens
    [B, max_depth + 1], `emitted_tokens`)."""
    path, n_acc, bonus = accept_walk(tree, choice_BN)
    path = torch.where(alive_B[:, None], path, -1)
    path[:, 0] = torch.where(alive_B, 0, -1)
    return path, n_acc, bonus, emitted_tokens(tree, path, bonus)


@functools.cache  # one compiled body per process (compile_static: a version per bucket shape)
def accept_paths_compiled():
    """`accept_paths` under torch.compile, for graph bodies: eager, its walk is ~8 small kernels per depth
    step (~60 a step); compiled, a few."""
    return compile_static(accept_paths)
