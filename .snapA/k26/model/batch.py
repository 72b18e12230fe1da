"""The attention description of one forward: which cache row each sequence uses, how long its prefix
is, the RoPE position of every new token, and who may see whom among the new tokens.

A causal chunk is the special case of a tree that is a single chain, so prefill, decode, DFlash
chains and DDTree verification all travel through the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import causal_words, tree_mask_to_words


@dataclass
class AttnBatch:
    positions_BN: torch.Tensor  # int64 RoPE positions: prefix length + depth in the tree
    rows_B: torch.Tensor  # int64 cache row of each sequence
    prefix_lens_B: torch.Tensor  # int64 tokens already in the cache, all visible
    mask_words_BNW: torch.Tensor  # int64 ancestor bitmask among the N new tokens (self included)
    # Reference paths attend over whole cache rows (masked) instead of reading the live length back to the
    # host: slower, but sync-free, so CUDA-graph capturable and replay-identical (graph bodies set it).
    static: bool = False
    # A prompt's prefill: no other forward must reproduce its bits, so layers may take their fastest path
    # (MLA: cuBLAS rather than the batch-invariant small-M kernel above 64 rows).
    prefill: bool = False

    @property
    def num_new(self) -> int:
        return self.positions_BN.shape[1]

    @classmethod
    def causal(
        cls,
        prefix_lens_B: torch.Tensor,
        n: int,
        rows_B: torch.Tensor | None = None,
        static: bool = False,
        prefill: bool = False,
    ) -> AttnBatch:
        dev = prefix_lens_B.device
        b = prefix_lens_B.shape[0]
        rows = torch.arange(b, device=dev) if rows_B is None else rows_B
        pos = prefix_lens_B[:, None] + torch.arange(n, device=dev)
        return cls(pos, rows, prefix_lens_B, causal_words(b, n, dev), static, prefill)

    @classmethod
    def tree(
        cls,
        prefix_lens_B: torch.Tensor,
        ancestors_BNN: torch.Tensor,
        rows_B: torch.Tensor | None = None,
        static: bool = False,
    ):
        """ancestors[b, i, j]: node j is i itself or an ancestor of i; node 0 is the root."""
        b = prefix_lens_B.shape[0]
        rows = torch.arange(b, device=prefix_lens_B.device) if rows_B is None else rows_B
        depth_BN = ancestors_BNN.sum(-1) - 1
        return cls(
            prefix_lens_B[:, None] + depth_BN, rows, prefix_lens_B, tree_mask_to_words(ancestors_BNN), static
        )
