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
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**63
        ):
            raise bad("seed", "must be None or an integer in [-2**63, 2**63)")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(i, int) and i >= 0 for i in ids):
                raise bad("stop_token_ids", "must be non-negative integers")
            object.__setattr__(self, "stop_token_ids", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(x, str) and x for x in stop):
            raise bad("stop", "must be non-empty strings")
        object.__setattr__(self, "stop", stop)


# The graph samplers, cheapest first; each one also serves the rows of those before it: "greedy" (every row
# temperature 0: the shards' argmax, no noise), "sample" (the exponential race over the full softmax),
# "filter" (some sampled row uses top-p or top-k: a sort of the whole vocabulary per node).
MODES = ("greedy", "sample", "filter")


def sampling_mode(params) -> str:
    """The cheapest mode of `MODES` that serves every row of `params` (SamplingParams, None: a free row)."""
    ps = [p for p in params if p is not None and p.temperature > 0]
    if not ps:
        return "greedy"
    return "filter" if any(p.top_p < 1 or p.top_k > 0 for p in ps) else "sample"


@dataclass
class RowSampling:
    """Per-row sampling of one decode batch, as device tensors so that one captured graph serves any mix
    of requests (continuous batching admits rows with their own parameters between steps).

    `noise` holds Exp(1) draws [B, N, V] filled before the step from each row's own generator (seeded
    requests reproduce) or the batch's shared one: the step itself never touches a generator, so it is
    graph-safe and every TP rank, filling from identically seeded generators, draws the same samples."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    greedy: bool  # host-known: every row greedy, so the shards' argmax serves and no noise is needed
    filtered: bool  # host-known: some row uses top_p < 1 or top_k > 0 (needs the sort)
    noise: torch.Tensor | None = None  # [B, >= N, V] exponential draws; None when greedy

    @classmethod
    def of(
        cls, params: list[SamplingParams | None], device, noise: torch.Tensor | None = None
    ) -> RowSampling:
        """From one SamplingParams per row (None: a free row, sampled greedily)."""
        ps = [p or SamplingParams() for p in params]
        f32 = {"dtype": torch.float32, "device": device}
        return cls.in_mode(
            sampling_mode(ps),
            torch.tensor([float(p.temperature) for p in ps], **f32),
            torch.tensor([float(p.top_p) for p in ps], **f32),
            torch.tensor([p.top_k for p in ps], dtype=torch.long, device=device),
            noise,
        )

    @classmethod
    def in_mode(cls, mode: str, temperature, top_p, top_k, noise: torch.Tensor | None) -> RowSampling:
        """Per-row tensors sampled in `mode` (one of `MODES`): what a captured step reads, its mode fixed
        when it was captured."""
        greedy = mode == "greedy"
        return cls(temperature, top_p, top_k, greedy, mode == "filter", None if greedy else noise)

    def rows(self, index: torch.Tensor) -> RowSampling:
        """The sub-batch of rows `index` (prefill of newly admitted rows)."""
        noise = None if self.noise is None else self.noise[index]
        return RowSampling(
            self.temperature[index], self.top_p[index], self.top_k[index], self.greedy, self.filtered, noise
        )


def sample_rows(logits_BNV: torch.Tensor, rs: RowSampling) -> torch.Tensor:
    """One token per row and position [B, N] from fp32 logits, each row with its own temperature, top-p
    and top-k; greedy rows take the argmax. No host sync, no generator: graph-safe."""
    B, N, V = logits_BNV.shape
    logits = logits_BNV.float()
    best = logits.argmax(-1)
    if rs.greedy:
        return best
    t = rs.temperature[:, None, None]
    logits = logits / torch.where(t > 0, t, 1.0)
    q = rs.noise[:, :N, :V]
    if not rs.filtered:  # the exponential race over the full softmax
        return torch.where(t[..., 0] > 0, (torch.softmax(logits, -1) / q).argmax(-1), best)
    srt, order = logits.sort(dim=-1, descending=True)
    k = torch.where(rs.top_k > 0, rs.top_k.clamp(max=V), V)[:, None, None].expand(B, N, 1)
    srt = srt.masked_fill(srt < srt.gather(-1, k - 1), float("-inf"))  # ties with the k-th stay, as `sample`
    p = torch.softmax(srt, dim=-1)
    # drop a token when the mass before it already reaches top_p; the first token always stays
    # (top_p = 1 keeps every token: the fp32 cumulative sum reaches 1.0 before the tail ends)
    cut = ((p.cumsum(-1) - p) >= rs.top_p[:, None, None]) & (rs.top_p < 1)[:, None, None]
    p = p.masked_fill(cut, 0.0)
    # the race runs in sorted order: the draws are i.i.d., so which one meets which token does not matter
    pick = order.gather(-1, (p / q).argmax(-1, keepdim=True))[..., 0]
    return torch.where(t[..., 0] > 0, pick, best)


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of the stop strings (0 if none): what a stream
    holds back until the next tokens say whether a stop string follows."""
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
