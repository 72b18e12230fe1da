"""Prefix reuse on the static caches: which tokens each cache row holds, where a new prompt's longest cached
prefix lies, and which row the idle rows of a speculative batch write into.

A row of the latent cache (and of the drafter's context cache) keeps the latents of the tokens it committed,
at their positions, until something overwrites them. A prompt admitted into a row that already holds a
prefix of it skips that prefix's prefill; one whose prefix lies in another row copies it first (70 KB per
token over K2.6's 61 layers: a device copy instead of a forward). Multi-turn chat (each turn's prompt is the
last turn's prompt and answer plus a little), `n` choices of one prompt and batches sharing a system prompt
prefill their shared part once.

Rows of one admission may feed each other: a prompt whose best source is another prompt of the same call
waits for a second prefill "wave" after it (only when that saves at least `min_wave` tokens).

Idle slots of a speculative batch still run every step (the batch is rectangular) at position 0 of their
row, which would overwrite the cached prefix of every finished row: they all run in one "parking" row
instead (`park`), whose first positions (all they write) the batch keeps aside meanwhile and puts back
before an admission reads any row (`kv_cache.HeadStash`). Autoregressive steps write an idle row at its
own frozen length, past anything it holds, and need no parking.

All of this is host bookkeeping, deterministic in the calls it sees, so every TP rank (each sees the same
mirrored calls) decides alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A second prefill wave costs one more forward, a whole pass over the weights and its launches, while the
# tokens it saves would have run in the first wave's forwards beside the others. Measured 2026-12-05 on an
# H200 with the embedded pair (profiling/results/2026-12-05-bench_prefix-h200.md): waiting a wave to copy a
# 512-token system prompt made the turn's TTFT 1.5x longer. At K2.6 scale 1,024 tokens of prefill compute
# (~2 x 32 B active parameters each) outweigh one more pass over the weights.
MIN_WAVE_TOKENS = 1024
_STRIDE = 256  # common_prefix compares slices of this many tokens before going token by token


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists (C-speed slice compares, then one
    stride token by token)."""
    n, i = min(len(a), len(b)), 0
    while i + _STRIDE <= n and a[i : i + _STRIDE] == b[i : i + _STRIDE]:
        i += _STRIDE
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Reuse:
    """Where one admitted prompt goes and what of it is already cached there."""

    slot: int  # its row
    keep: int  # positions [0, keep) of the prompt are in the row once the copy ran: its prefill starts there
    src: int | None = None  # the row that positions [have, keep) are copied from (None: no copy)
    have: int = 0  # what the row itself already held of the prompt (the copy's start)
    wave: int = 0  # prefill forward this prompt joins: w > 0 when its source is a prompt of wave w - 1


class PrefixCache:
    """Per cache row, the tokens whose latents (and drafter context) it holds at positions 0..n-1, for rows
    that hold no request; rows that do are described by their caller (`held` below: a live row's prompt and
    committed output)."""

    def __init__(self, rows: int, enabled: bool = True, min_wave: int = MIN_WAVE_TOKENS):
        self.enabled, self.min_wave = enabled, min_wave
        self.known: list[list[int]] = [[] for _ in range(rows)]
        self.freed_at = [0] * rows  # a clock: when the row last became free (oldest are given up first)
        self.clock = 0
        self.parked: int | None = None  # the row idle slots of a speculative batch run in

    def clear(self) -> None:
        """Forget what every free row holds (something else wrote into the caches; occupied rows are the
        caller's: `BatchState.overwritten`)."""
        self.known = [[] for _ in self.known]

    def plan(
        self,
        prompts: Sequence[list[int] | None],
        free: Sequence[int],
        held: dict[int, Sequence[int]],
        reuse: Sequence[bool] | None = None,
    ) -> list[Reuse]:
        """Rows for `prompts` among the `free` ones (the caller checked there are enough) and the prefix of
        each that is cached: in the row itself, or copied from any row (`held`: occupied rows' cached
        tokens; rows planned earlier in this call count with their whole prompt, from the wave after theirs).
        `reuse[i]` False: prompt i is prefilled whole (its prompt logprobs need every position's state). The
        last token of a prompt is always prefilled: its hidden state picks the first output token. A None
        prompt is not prefilled (max_tokens 0): it gets a row and leaves it holding nothing."""
        rows: dict[int, Sequence[int]] = {s: self.known[s] for s in free} | dict(held)
        planned: dict[int, Reuse] = {}  # rows given a prompt earlier in this call

        def options(s: int, p: list[int], limit: int) -> list[tuple[int, int, int]]:
            """(tokens, wave, row) a copy from row s can give: a row planned in this call holds its kept
            prefix once its own copy ran (copies run in plan order), the rest of its prompt after its wave."""
            n, r = min(common_prefix(rows[s], p), limit), planned.get(s)
            if r is None:
                return [(n, 0, s)]
            return [(min(n, r.keep), r.wave, s), (n, r.wave + 1, s)]

        left, plans = list(free), []
        for i, p in enumerate(prompts):
            p = p if p is not None else []
            limit = max(0, len(p) - 1) if self.enabled and (reuse is None or reuse[i]) else 0
            own = {s: min(common_prefix(rows[s], p), limit) for s in left}
            # the row: the most of this prompt it holds already, else the one holding least, freed longest ago
            slot = max(left, key=lambda s: (own[s], -len(rows[s]), -self.freed_at[s]))
            plan = Reuse(slot, own[slot], have=own[slot])
            if limit > plan.keep:
                # a copy: the most tokens at the earliest wave; a later wave only for `min_wave` more
                opts = sorted(
                    (o for s in rows if s != slot for o in options(s, p, limit)), key=lambda o: (o[1], -o[0])
                )
                for n, wave, src in opts:
                    more = n - plan.keep
                    if more > 0 and (more >= self.min_wave or wave == plan.wave):
                        plan = Reuse(slot, n, src, own[slot], wave)
            plans.append(plan)
            left.remove(slot)
            rows[slot], planned[slot] = p, plan
        return plans

    def admitted(self, slot: int) -> None:
        """`slot` now holds a request (its tokens are its caller's `held` from now on)."""
        self.known[slot] = []

    def released(self, slot: int, tokens: list[int]) -> None:
        """`slot` holds no request any more; `tokens` are the ones whose latents it holds."""
        self.known[slot] = tokens
        self.clock += 1
        self.freed_at[slot] = self.clock

    def park(self, idle: Sequence[int], free: Sequence[int]) -> int | None:
        """The row the `idle` slots (free, or finished and not yet released) of a speculative batch run in:
        the current one while it is idle, else a free one holding least (freed longest ago), else any idle
        one. Its first positions are the caller's to keep aside (`kv_cache.HeadStash`). None: none idle."""
        if self.parked not in idle:
            spare = set(free)
            pool = [s for s in idle if s in spare] or list(idle)
            self.parked = min(pool, key=lambda s: (len(self.known[s]), self.freed_at[s]), default=None)
        return self.parked


def cached_tokens(prompt: list[int], output: list[int]) -> list[int]:
    """The tokens a request's row holds the latents of: its prompt and every output token but the last
    (each step commits the tokens it verified; the newest one is only fed to the next step). A stop cut
    can leave more committed than the output shows, never less."""
    return (prompt + output)[: len(prompt) + len(output) - 1] if output else list(prompt)
