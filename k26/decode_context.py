"""`DecodeContext`: what decoding (the decoder, admission, the batch's steps) needs from the `LLM`,
injected, so that nothing below the engine sees the LLM itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .graphs import Bucket
from .kv_cache import DrafterCache, LatentCache
from .model import KimiK2
from .model.drafter import DFlashDrafter
from .spec.prefill import MAX_CHUNK
from .spec.step import SpecConfig, StepModels
from .spec.tree import TreeTables
from .tokenizer import Tokenizer


@dataclass
class DecodeContext:
    """What decoding needs from the `LLM`, injected (the decoder never sees the LLM itself)."""

    model: KimiK2  # plain: prefill and eager steps
    target: Callable  # compiled or plain: the captured steps
    drafter: DFlashDrafter | None
    cache: LatentCache
    dcache: DrafterCache | None
    tokenizer: Tokenizer
    max_model_len: int
    device: torch.device
    buckets_for: Callable[[SpecConfig], list[Bucket]]
    tp_size: int = 1
    absorb: bool = True
    graphs: bool = False
    progress: bool = False
    static: bool = False  # eager steps with the graphs' static shapes too (AttnBatch.static): for comparisons
    tables: TreeTables = field(default_factory=TreeTables)  # tree padding constants, as long as the graphs
    drafter_fwd: Callable | None = None  # compiled drafter for the captured steps (None: `drafter`)
    compiled: bool = False  # the captured steps' glue under torch.compile too (StepModels.compiled)
    prefix_cache: bool = True  # prompts start where a cache row holds their prefix (prefix_cache.py)
    chunk: int = MAX_CHUNK  # prefill positions per row and forward (spec/prefill.py)
    prefill_budget: int = (
        2 * MAX_CHUNK
    )  # deferred prefill positions per step while rows decode (admission.py)

    def models(self, target: Callable | None = None) -> StepModels:
        kv, dc = self.cache.kv_LRTC, self.dcache
        model = self.model if target is None else target  # not `or`: bool() of a compiled module calls len()
        drafter = self.drafter if target is None or self.drafter_fwd is None else self.drafter_fwd
        compiled = self.compiled and target is not None
        return StepModels(model, drafter, kv, dc, self.absorb, self.static, self.tables, compiled)

    @property
    def block(self) -> int:
        """The drafter's block size (1 without a drafter)."""
        return self.drafter.cfg.block_size if self.drafter is not None else 1

    def room(self, nodes: int) -> int:
        """The longest sequence that still has cache room for a speculative step of `nodes` tokens."""
        room = self.max_model_len - nodes
        if self.dcache is not None:
            room = min(room, self.dcache.k.shape[2] - self.drafter.cfg.block_size)
        return room
