"""Static latent KV cache: [layers, rows, max_len, kv_lora_rank + qk_rope_head_dim].

One row per live sequence, allocated once, so every forward (prefill, decode, tree verify) addresses
it with tensors only (row ids and prefix lengths) and CUDA graphs can capture it. 576 values per
token per layer for K2: 70,272 bytes per token over 61 layers in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .drafter_config import DrafterConfig


@dataclass
class LatentCache:
    kv_LRTC: torch.Tensor

    @classmethod
    def allocate(cls, cfg: ModelConfig, rows: int, max_len: int, dtype: torch.dtype, device) -> LatentCache:
        shape = (cfg.num_hidden_layers, rows, max_len, cfg.latent_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device))

    @property
    def rows(self) -> int:
        return self.kv_LRTC.shape[1]

    @property
    def max_len(self) -> int:
        return self.kv_LRTC.shape[2]

    def copy(self, src: int, dst: int, start: int, end: int) -> None:
        """Positions [start, end) of row `src` into row `dst` (a cached prefix reused, prefix_cache.py)."""
        self.kv_LRTC[:, dst, start:end].copy_(self.kv_LRTC[:, src, start:end])

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
        return cfg.num_hidden_layers * cfg.latent_dim * torch.finfo(dtype).bits // 8


@dataclass
class DrafterCache:
    """Per-layer K/V of committed context rows only: [layers, rows + 1, max_len, kv_heads, head_dim].
    Block rows are never stored, so nothing has to be cropped after a draft. The extra last row is a
    trash row that absorbs padding writes, keeping every write static-shaped."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(
        cls, cfg: DrafterConfig, rows: int, max_len: int, dtype: torch.dtype, device, tp_size: int = 1
    ):
        shape = (cfg.num_hidden_layers, rows + 1, max_len, cfg.num_key_value_heads // tp_size, cfg.head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        )

    @staticmethod
    def bytes_per_token(cfg: DrafterConfig, dtype: torch.dtype = torch.bfloat16, tp_size: int = 1) -> int:
        """Bytes of one row's position: K and V over the layers (`allocate`'s shape; it adds a trash row)."""
        heads = cfg.num_key_value_heads // tp_size
        return 2 * cfg.num_hidden_layers * heads * cfg.head_dim * torch.finfo(dtype).bits // 8

    def copy(self, src: int, dst: int, start: int, end: int) -> None:
        """Context positions [start, end) of row `src` into row `dst` (prefix_cache.py)."""
        for t in (self.k, self.v):
            t[:, dst, start:end].copy_(t[:, src, start:end])


class HeadStash:
    """One cache row's first `n` positions, kept aside while idle slots of a speculative batch run in that
    row (prefix_cache.py's parking row: they write only positions below n), put back before anything reads
    the row again. `tensors`: the caches, each [layers, rows, positions, ...]."""

    def __init__(self, tensors: list[torch.Tensor], n: int):
        self.tensors, self.n = tensors, n
        self.saved = [torch.empty_like(t[:, 0, :n]) for t in tensors]
        self.row: int | None = None  # whose head is saved

    def save(self, row: int) -> None:
        self.restore()
        for s, t in zip(self.saved, self.tensors):
            s.copy_(t[:, row, : self.n])
        self.row = row

    def restore(self) -> None:
        if self.row is not None:
            for s, t in zip(self.saved, self.tensors):
                t[:, self.row, : self.n].copy_(s)
            self.row = None
