"""Sampling parameters and a sampler that never syncs with the host (exponential race, as gpt-fast)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] | None = None  # None = the tokenizer's end-of-turn ids
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad("temperature", "must be a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must lie in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise bad("max_tokens", "must be an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(i, int) and i >= 0 for i in ids):
                raise bad("stop_token_ids", "must be non-negative integers")
            object.__setattr__(self, "stop_token_ids", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(x, str) and x for x in stop):
            raise bad("stop", "must be non-empty strings")
        object.__setattr__(self, "stop", stop)


def sample(logits_BV: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row [B] (int64) from fp32 logits, entirely on the logits' device."""
    if p.temperature == 0:
        return logits_BV.argmax(-1)
    logits = logits_BV.float() / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    # argmax(p / Exp(1)) samples from p (the exponential race) without a multinomial's host sync.
    q = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / q).argmax(-1)
