"""Sampling parameters and a sampler that never syncs with the host (exponential race, as gpt-fast)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .penalties import Penalties


class SamplingError(ValueError):
    """A bad SamplingParams field, carrying which one (a front end names its own spelling: the CLI's flag)."""

    def __init__(self, field: str, value, why: str) -> None:
        super().__init__(f"SamplingParams.{field}={value!r}: {why}")
        self.field, self.value, self.why = field, value, why

    def __reduce__(self):  # (pickled across TP ranks, copied: the default passes only the message back)
        return type(self), (self.field, self.value, self.why)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] | None = None  # None = the tokenizer's end-of-turn ids
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    # None: off; k: each generated token's log-probability and the k most probable tokens at its position
    # (the target's raw distribution: log-softmax of its logits, before temperature, top-p and top-k)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (given those before)
    # OpenAI's penalties on tokens generated so far (k26/penalties.py): each logit shifted by
    # -frequency_penalty x count - presence_penalty x (count > 0); both in [-2, 2]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # {token id: bias in [-100, 100]} added to that token's logit (a dict, or (id, bias) pairs); kept as
    # sorted pairs. Penalties and biases act before temperature, top-p and top-k; logprobs stay raw.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: no stop id (logit -inf) and no stop string ends the answer before this many tokens
    min_tokens: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return SamplingError(field, getattr(self, field), why)

        for name in _INT_FIELDS + _REAL_FIELDS:  # NumPy scalars (np.int64 seeds, np.float32 temperatures)
            object.__setattr__(self, name, builtin_number(getattr(self, name)))
        if not _real(self.temperature) or not 0 <= self.temperature < math.inf:  # (inf: uniform, silently)
            raise bad("temperature", "must be a finite number >= 0")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must lie in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k < 2**31:
            raise bad("top_k", "must be an integer in [0, 2**31)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise bad("max_tokens", "must be an integer >= 0")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**63
        ):
            raise bad("seed", "must be None or an integer in [-2**63, 2**63)")
        if self.stop_token_ids is not None:
            stops = self.stop_token_ids
            if isinstance(stops, torch.Tensor):  # (as prompts take them: a 1-d integer tensor, as its list)
                integer = not (stops.is_floating_point() or stops.is_complex() or stops.dtype == torch.bool)
                if stops.dim() != 1 or not integer:
                    raise bad("stop_token_ids", "must be None or a list of token ids (a 1-d integer tensor)")
                stops = stops.tolist()
            if isinstance(stops, (str, bytes, Mapping)) or not hasattr(stops, "__iter__"):  # (dict: its keys)
                raise bad("stop_token_ids", "must be None or a list of token ids")
            ids = tuple(builtin_number(i) for i in stops)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise bad("stop_token_ids", "must be non-negative integers")
            object.__setattr__(self, "stop_token_ids", ids)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (
                not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS
            ):
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.stop is not None and (
            isinstance(self.stop, (torch.Tensor, Mapping))  # (a 0-d tensor raised torch's "iteration over a
            or not isinstance(self.stop, str)  # 0-d tensor"; a dict was taken as its keys)
            and not hasattr(self.stop, "__iter__")
        ):
            raise bad("stop", "must be a string or a list of strings")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(x, str) and x for x in stop):
            raise bad("stop", "must be non-empty strings")
        # plain str: a subclass (a user's, or numpy.str_) compares alike but must not travel to TP ranks,
        # which may not be able to import its class
        object.__setattr__(self, "stop", tuple(str.__str__(x) for x in stop))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _real(v) or not -2 <= v <= 2:
                raise bad(name, "must be a number in [-2, 2]")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias, bad))
        m = self.min_tokens
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")

    @property
    def penalized(self) -> bool:
        """Some penalty, logit bias or min_tokens shifts this row's logits."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )


_INT_FIELDS = ("top_k", "max_tokens", "seed", "logprobs", "prompt_logprobs", "min_tokens")
_REAL_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


def builtin_number(v):
    """A non-builtin number (a NumPy scalar: np.int64, np.float32) as the builtin int / float it stands for,
    so the checks below take it as they take Python's; anything else (bools included) as it is."""
    if type(v) in (int, float) or isinstance(v, bool) or not isinstance(v, numbers.Real):
        return v  # (np.float64 is a float subclass: converted below, as np.float32 is)
    return int(v) if isinstance(v, numbers.Integral) else float(v)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _logit_bias(lb, bad) -> tuple[tuple[int, float], ...]:
    """SamplingParams.logit_bias as sorted (id, bias) pairs, from a mapping or pairs (None: none)."""
    if lb is None:
        return ()
    try:
        pairs = list(lb.items()) if isinstance(lb, Mapping) else [tuple(x) for x in lb]
        pairs = [tuple(builtin_number(v) for v in pair) for pair in pairs]
    except TypeError:
        raise bad("logit_bias", "expected {token id: bias} or (id, bias) pairs") from None
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], int) or isinstance(pair[0], bool) or pair[0] < 0:
            raise bad("logit_bias", f"{pair!r}: expected (token id >= 0, bias)")
        if not _real(pair[1]) or not -100 <= pair[1] <= 100:
            raise bad("logit_bias", f"token {pair[0]}: bias {pair[1]!r} must be a number in [-100, 100]")
    ids = [i for i, _ in pairs]
    if len(set(ids)) != len(ids):
        raise bad("logit_bias", "a token id appears twice")
    return tuple(sorted((i, float(v)) for i, v in pairs))


MAX_LOGPROBS = 20  # most probable tokens a position's logprobs may list (OpenAI's top_logprobs limit)

# The graph samplers, cheapest first; each one also serves the rows of those before it: "greedy" (every row
# temperature 0: the shards' argmax, no noise), "sample" (the exponential race over the full softmax),
# "filter" (some sampled row uses top-p or top-k: a sort of the whole vocabulary per node; also any row with
# penalties or a logit bias, greedy ones included — one mode more would mean a quarter more graphs captured
# per batch; a penalised greedy row pays for a sort it does not need), "logprobs" (some row asks for
# logprobs: "filter" plus every node's chosen and MAX_LOGPROBS most probable tokens' log-probabilities).
MODES = ("greedy", "sample", "filter", "logprobs")


def seeded_generator(seed: int, device) -> torch.Generator:
    """A request's generator for `seed` on `device`. A CPU generator (mt19937) keeps only a seed's low 32
    bits, so seeds differing above them (7 and 7 + 2**32) drew the same tokens there: on the CPU the high
    half, multiplied by an odd constant, is xored into the low one first. A seed in [0, 2**32) keeps its
    stream, seeds sharing a high half stay distinct (choice i of `n` samples with seed + i), and -1 is not 0
    (a plain xor of the halves made -k collide with k - 1). CUDA generators take all 64 bits."""
    g = torch.Generator(device=device)
    if g.device.type == "cpu":
        u = seed % 2**64
        seed = (u ^ ((u >> 32) * 0x9E3779B1)) & 0xFFFFFFFF
    return g.manual_seed(seed)


def sampling_mode(params) -> str:
    """The cheapest mode of `MODES` that serves every row of `params` (SamplingParams, None: a free row)."""
    params = [p for p in params if p is not None]
    if any(p.logprobs is not None for p in params):
        return "logprobs"
    if any(p.penalized for p in params):
        return "filter"
    ps = [p for p in params if p.temperature > 0]
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
    logprobs: bool = False  # host-known: the step also returns log-probabilities (`token_logprobs`)
    # the rows' penalties and logit biases (k26/penalties.py); only the sorting modes carry them
    penalties: Penalties | None = None

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
    def in_mode(
        cls,
        mode: str,
        temperature,
        top_p,
        top_k,
        noise: torch.Tensor | None,
        penalties: Penalties | None = None,
    ) -> RowSampling:
        """Per-row tensors sampled in `mode` (one of `MODES`): what a captured step reads, its mode fixed
        when it was captured. `penalties` apply in the sorting modes ("filter", "logprobs") only."""
        greedy, lp, sorts = mode == "greedy", mode == "logprobs", mode in ("filter", "logprobs")
        pen = penalties if sorts else None
        return cls(temperature, top_p, top_k, greedy, sorts, None if greedy else noise, lp, pen)

    def rows(self, index: torch.Tensor) -> RowSampling:
        """The sub-batch of rows `index` (prefill of newly admitted rows)."""
        noise = None if self.noise is None else self.noise[index]
        return RowSampling(
            self.temperature[index],
            self.top_p[index],
            self.top_k[index],
            self.greedy,
            self.filtered,
            noise,
            self.logprobs,
            None if self.penalties is None else self.penalties.rows(index),
        )


def sample_rows(logits_BNV: torch.Tensor, rs: RowSampling) -> torch.Tensor:
    """One token per row and position [B, N] from fp32 logits, each row with its own temperature, top-p
    and top-k; greedy rows take the argmax. No host sync, no generator: graph-safe."""
    B, N, V = logits_BNV.shape
    logits = logits_BNV.float()
    best = logits.argmax(-1)
    if rs.greedy or rs.noise is None:  # (no noise: no row samples, say a "logprobs" batch of greedy rows)
        return best
    t = rs.temperature[:, None, None]
    # a temperature clamped to [1e-20, 1e20] ([B], not another pass over the logits): 1e-40 overflowed every
    # logit to +-inf (inf - inf: NaN probabilities, token 0); 1e-20 is greedy in effect and keeps 1e18 of
    # headroom. A finite one beyond float32 (1e39) is inf here: every logit became 0 (top-k kept the whole
    # vocabulary) and a -inf one NaN (the race picked a stop id min_tokens held back); 1e20: uniform in effect
    logits = logits / torch.where(t > 0, t.clamp(1e-20, 1e20), 1.0)
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
    # each token meets its own draw (q at its id), as in the full-softmax race: the same noise picks the same
    # token whichever of the modes serves the row (a batch's mode follows its other rows)
    pick = order.gather(-1, (p / q.gather(-1, order)).argmax(-1, keepdim=True))[..., 0]
    return torch.where(t[..., 0] > 0, pick, best)


@dataclass
class StepLogprobs:
    """Log-probabilities of a step's positions under the target's raw distribution (log-softmax of its
    logits): the chosen token's [B, N] and the MAX_LOGPROBS most probable tokens' (ids and values,
    descending) [B, N, K]. Device tensors (a graph's static buffers, or a step's results)."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top: torch.Tensor

    @classmethod
    def empty(cls, batch: int, width: int, vocab: int, device) -> StepLogprobs:
        """Static buffers for a graph's step: `width` positions a row, top min(MAX_LOGPROBS, vocab)."""
        k = min(MAX_LOGPROBS, vocab)
        f = {"dtype": torch.float32, "device": device}
        return cls(
            torch.zeros(batch, width, **f),
            torch.zeros(batch, width, k, dtype=torch.long, device=device),
            torch.zeros(batch, width, k, **f),
        )

    def copy_(self, other: StepLogprobs, non_blocking: bool = False) -> None:
        for a, b in ((self.chosen, other.chosen), (self.top_ids, other.top_ids), (self.top, other.top)):
            a.copy_(b, non_blocking=non_blocking)

    def pinned_like(self) -> StepLogprobs:
        """Host buffers to copy these into without a sync (pinned memory)."""
        t = (self.chosen, self.top_ids, self.top)
        return StepLogprobs(*(torch.empty_like(x, device="cpu").pin_memory() for x in t))

    def cpu(self) -> StepLogprobs:
        return StepLogprobs(self.chosen.cpu(), self.top_ids.cpu(), self.top.cpu())

    def row(self, b: int, n: int, k: int) -> list[TokenLogprob]:
        """Row b's first n positions with their top k, from host tensors: only rows that asked are read,
        only as far as they asked (a whole [B, J, MAX_LOGPROBS] into Python objects cost ~2 ms at B = 64)."""
        chosen, ids, top = (
            self.chosen[b, :n].tolist(),
            self.top_ids[b, :n, :k].tolist(),
            self.top[b, :n, :k].tolist(),
        )
        return [TokenLogprob(c, tuple(zip(i, t))) for c, i, t in zip(chosen, ids, top)]


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its position's most probable tokens (id, log-prob),
    descending (as many as the request's `logprobs`)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits_BNV: torch.Tensor, choice_BN: torch.Tensor, k: int = MAX_LOGPROBS) -> StepLogprobs:
    """`StepLogprobs` of `choice_BN` (top k) from fp32 logits (no [B, N, V] log-softmax kept: the top values
    and the chosen logit minus the log-sum-exp). Graph-safe."""
    logits = logits_BNV.float()
    lse = logits.logsumexp(-1, keepdim=True)
    top, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return StepLogprobs((logits.gather(-1, choice_BN[..., None]) - lse)[..., 0], ids, top - lse)


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of the stop strings (0 if none): what a stream
    holds back until the next tokens say whether a stop string follows."""
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
