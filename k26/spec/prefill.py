"""Prefill: prompts into their cache rows, a chunk of positions per forward, each from where its row's
cached prefix ends; and the prompt's own log-probabilities from the same forwards.

A forward takes at most `MAX_CHUNK` new tokens per row: the tree-attention kernel's largest query (K2.6's
shapes have no other attention path), and it bounds a long prompt's activations. Rows whose suffixes
differ in length share forwards: a row with less left than the forward's width ends its window at its last
token and starts it earlier (re-running up to width - 1 positions it holds: their latents written again,
rounded as this forward rounds) rather
than padding past its end, so no write lands beyond a prompt's length unless the whole prompt is shorter
than the window (then within [0, window), inside the cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..model import AttnBatch, KimiK2
from ..ops.attention_cuda import MAX_NEW_TOKENS
from ..profiling import nvtx_range
from ..sampling import StepLogprobs, TokenLogprob

if TYPE_CHECKING:
    from .step import StepModels

MAX_CHUNK = MAX_NEW_TOKENS


@dataclass
class PromptLogprobs:
    """One prompt's `TokenLogprob`s of ids[1:] (each given the tokens before it; top k), gathered chunk by
    chunk as its prefill produces the hidden states: each rank's vocabulary shard merged without a gather
    (`VocabHead.token_logprobs`); the values stay on the device until `result` reads them back once."""

    target: KimiK2
    ids: list[int]
    k: int
    parts: list[StepLogprobs] = field(default_factory=list)

    def add(self, h_TD: torch.Tensor, first: int) -> None:
        """Hidden states of positions first, first + 1, ...: each predicts the next id (the last position
        predicts nothing)."""
        n = min(h_TD.shape[0], len(self.ids) - 1 - first)
        if n <= 0:
            return
        nxt = torch.tensor(self.ids[first + 1 : first + 1 + n], device=h_TD.device)
        self.parts.append(self.target.lm_head.token_logprobs(h_TD[None, :n], nxt[None], self.k))

    def result(self) -> list[TokenLogprob | None]:
        """One entry per prompt token, None for the first (nothing before it)."""
        if not self.parts:
            return [None]
        fields = ("chosen", "top_ids", "top")
        lp = StepLogprobs(*(torch.cat([getattr(p, f) for p in self.parts], 1) for f in fields))
        return [None, *lp.cpu().row(0, len(self.ids) - 1, self.k)]


def windows(lens: list[int], done: list[int], width: int) -> list[int]:
    """Where each unfinished row's next window of `width` positions starts: at its progress, or earlier so
    that it ends at the prompt's last token (never before 0)."""
    return [min(d, max(0, n - width)) for n, d in zip(lens, done)]


class Prefill:
    """Prompts going into their cache `rows` from `starts` (positions already there; default 0), one forward
    of at most `chunk` positions per row at a time (`forward`), and (`aux`) their features into the
    drafter's context. `each(i, h_TD, first)`: prompt i's hidden states of positions first, first + 1, ... of
    one forward (prompt logprobs; only positions it did not see before). `last[i]`: prompt i's last hidden
    state once its prefill ended."""

    def __init__(
        self,
        m: StepModels,
        prompts: list[list[int]],
        rows: list[int],
        aux: bool,
        starts: list[int] | None = None,
        chunk: int = MAX_CHUNK,
        each: Callable[[int, torch.Tensor, int], None] | None = None,
    ):
        self.m, self.prompts, self.rows, self.chunk, self.each = m, prompts, rows, chunk, each
        self.lens = [len(p) for p in prompts]
        self.done = list(starts or [0] * len(prompts))
        if not all(0 <= d < n for d, n in zip(self.done, self.lens)):  # the last token always runs
            raise ValueError(
                f"prefill: starts {self.done} must lie in [0, prompt length) for lengths {self.lens}"
            )
        self.aux_layers = m.drafter.cfg.target_layer_ids if aux else ()
        self.last: list[torch.Tensor | None] = [None] * len(prompts)

    def _going(self) -> list[int]:
        return [i for i, (d, n) in enumerate(zip(self.done, self.lens)) if d < n]

    @property
    def finished(self) -> bool:
        return not self._going()

    def cost(self) -> int:
        """Positions the next forward runs (rows x width): what a prefill budget counts."""
        go = self._going()
        return len(go) * min(self.chunk, max((self.lens[i] - self.done[i] for i in go), default=0))

    def drop(self, i: int) -> None:
        """Prompt i runs no further (its request left)."""
        self.done[i] = self.lens[i]

    def forward(self) -> list[int]:
        """One forward of every unfinished prompt's next window; returns those whose prefill ended."""
        m, dev, go = self.m, self.m.cache_LRTC.device, self._going()
        T = min(self.chunk, max(self.lens[i] - self.done[i] for i in go))
        win = windows([self.lens[i] for i in go], [self.done[i] for i in go], T)
        ids = torch.zeros(len(go), T, dtype=torch.long)
        for j, (i, w) in enumerate(zip(go, win)):
            seg = self.prompts[i][w : w + T]
            ids[j, : len(seg)] = torch.tensor(seg)
        at = torch.tensor(win, device=dev)
        r = torch.tensor([self.rows[i] for i in go], device=dev)
        with nvtx_range("prefill"):
            batch = AttnBatch.causal(at, T, r, prefill=True)
            h, feats = m.target(ids.to(dev), batch, m.cache_LRTC, aux_layers=self.aux_layers, absorb=m.absorb)
            if self.aux_layers:
                pos = at[:, None] + torch.arange(T, device=dev)
                n = torch.tensor([self.lens[i] for i in go], device=dev)
                m.drafter.append_context(m.dcache.k, m.dcache.v, feats, pos, r, valid_BC=pos < n[:, None])
        ended = []
        for j, (i, w) in enumerate(zip(go, win)):
            end = min(self.lens[i], w + T)
            if self.each is not None:
                self.each(i, h[j, self.done[i] - w : end - w], self.done[i])
            if end == self.lens[i]:
                self.last[i] = h[j, end - 1 - w]
                ended.append(i)
            self.done[i] = end
        return ended


def prefill(m: StepModels, prompts: list[list[int]], rows: list[int], aux: bool, **kw) -> torch.Tensor:
    """`Prefill` (keyword arguments: its starts, chunk, each) run to its end; returns each prompt's last
    hidden state [B, D]."""
    p = Prefill(m, prompts, rows, aux, **kw)
    while not p.finished:
        p.forward()
    return torch.stack(p.last)
