"""Prefill: prompts into their cache rows, a chunk of positions per forward, each from where its row's
cached prefix ends; and the prompt's own log-probabilities from the same forwards.

A forward takes at most `MAX_CHUNK` new tokens per row: the tree-attention kernel's largest query (K2.6's
shapes have no other attention path), and it bounds a long prompt's activations. Rows whose suffixes
differ in length share forwards: a row with less left than the forward's width ends its window at its last
token and starts it earlier (re-running a few positions it holds: the same latents written again) rather
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


def prefill(
    m: StepModels,
    prompts: list[list[int]],
    rows: list[int],
    aux: bool,
    starts: list[int] | None = None,
    chunk: int = MAX_CHUNK,
    each: Callable[[int, torch.Tensor, int], None] | None = None,
) -> torch.Tensor:
    """Prompts through the target into their cache `rows` from `starts` (positions already in the row;
    default 0), `chunk` positions per row and forward, and (`aux`) their features into the drafter's
    context. `each(i, h_TD, first)`: prompt i's hidden states of positions first, first + 1, ... of one
    forward (prompt logprobs; positions it saw before come again only if a window re-ran them: `first` is
    where the new ones start). Returns each prompt's last hidden state [B, D]."""
    dev = m.cache_LRTC.device
    lens = [len(p) for p in prompts]
    done = list(starts or [0] * len(prompts))
    if not all(0 <= d < n for d, n in zip(done, lens)):  # the last token always runs: its state is returned
        raise ValueError(f"prefill: starts {done} must lie in [0, prompt length) for lengths {lens}")
    last: list[torch.Tensor | None] = [None] * len(prompts)
    aux_layers = m.drafter.cfg.target_layer_ids if aux else ()
    with nvtx_range("prefill"):
        while go := [i for i, (d, n) in enumerate(zip(done, lens)) if d < n]:
            T = min(chunk, max(lens[i] - done[i] for i in go))
            win = windows([lens[i] for i in go], [done[i] for i in go], T)
            ids = torch.zeros(len(go), T, dtype=torch.long)
            for j, (i, w) in enumerate(zip(go, win)):
                seg = prompts[i][w : w + T]
                ids[j, : len(seg)] = torch.tensor(seg)
            at = torch.tensor(win, device=dev)
            r = torch.tensor([rows[i] for i in go], device=dev)
            batch = AttnBatch.causal(at, T, r, prefill=True)
            h, feats = m.target(ids.to(dev), batch, m.cache_LRTC, aux_layers=aux_layers, absorb=m.absorb)
            if aux_layers:
                pos = at[:, None] + torch.arange(T, device=dev)
                n = torch.tensor([lens[i] for i in go], device=dev)
                m.drafter.append_context(m.dcache.k, m.dcache.v, feats, pos, r, valid_BC=pos < n[:, None])
            for j, (i, w) in enumerate(zip(go, win)):
                end = min(lens[i], w + T)
                if each is not None:
                    each(i, h[j, done[i] - w : end - w], done[i])
                if end == lens[i]:
                    last[i] = h[j, end - 1 - w]
                done[i] = end
    return torch.stack(last)
