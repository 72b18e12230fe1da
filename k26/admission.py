"""Admission of prompts into a batch: each prompt's row and cached prefix (`PrefixCache.plan`), the copies of
cached prefixes between rows, the prefill of the rest (a forward per chunk and wave), prompt logprobs and
each row's first token — at once (`admit(..., wait=True)`), or a budget of positions per decode step
(`advance`, called by `Decoder.step`), so that a long prompt does not stall the rows already decoding.

Pending admissions run oldest first, a wave at a time: a wave's copies (in plan order), then its forwards;
a row is live (it steps, it emits) from the forward that ends its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .batch_state import BatchState
from .decode_context import DecodeContext
from .prefix_cache import Reuse
from .sampling import SamplingParams
from .spec.prefill import Prefill, PromptLogprobs


@dataclass
class Admission:
    """One admission's prompts still being prefilled (indices i into its slots / prompts / plans)."""

    slots: list[int]
    prompts: list[list[int]]
    params: list[SamplingParams]
    plans: list[Reuse]
    todo: list[int]  # prompts not prefilled yet
    scored: dict[int, PromptLogprobs]  # prompts whose logprobs were asked for
    waves: list[int]  # waves not started, in order
    job: Prefill | None = None  # the current wave's forwards
    now: list[int] = field(default_factory=list)  # the prompts `job` prefills (its index j -> now[j])

    def cancel(self, slot: int) -> None:
        """The request in `slot` left: its prompt runs no further, and prompts that were to copy from its
        unfinished row prefill that part themselves."""
        if slot not in self.slots or (i := self.slots.index(slot)) not in self.todo:
            return
        self.todo.remove(i)
        if i in self.now and self.job is not None:
            self.job.drop(self.now.index(i))
        self.source_lost(slot)

    def source_lost(self, slot: int) -> None:
        """Row `slot` will not hold what prompts still to copy from it expected (its prompt left unfinished,
        or a new request took the row: an autoregressive batch's idle steps write at the new length): they
        prefill that part themselves."""
        for j in self.todo:
            r = self.plans[j]
            if r.src == slot and (j not in self.now or self.job is None):
                self._copy_until(j, r.have)

    def _copy_until(self, j: int, keep: int) -> None:
        """Prompt j's row holds only positions [0, keep) of it when its wave's copies run (keep = have: no
        copy): prompts planned after it that copy from its row in that same wave (after its copy, before its
        forward) take only what the row holds then, and so on down such chains."""
        r = self.plans[j]
        self.plans[j] = replace(r, keep=keep, src=r.src if keep > r.have else None)
        for k in self.todo:
            q = self.plans[k]
            if k > j and q.src == self.slots[j] and q.wave == r.wave and q.keep > keep:
                self._copy_until(k, max(q.have, keep))


def admit(
    ctx: DecodeContext,
    state: BatchState,
    prompts: list[list[int]],
    params: list[SamplingParams],
    wait: bool = True,
) -> list[int]:
    """Put prompts into free slots, each where the most of it is cached; `wait`: prefill them now (and any
    admission still pending before them) and emit their first tokens, else leave that to `advance`.
    Returns the slots (the caller checked there are enough)."""
    state.unpark()  # every row holds what the prefix cache says it holds
    # prefilled: rows that generate, and rows asking for prompt logprobs
    pre = [i for i, sp in enumerate(params) if sp.max_tokens > 0 or sp.prompt_logprobs is not None]
    asked = [None if i not in pre else p for i, p in enumerate(prompts)]
    reuse = [sp.prompt_logprobs is None for sp in params]  # prompt logprobs: every position runs
    plans = state.prefix.plan(asked, state.free_slots(), state.held(), reuse)
    slots = [r.slot for r in plans]
    try:
        state.add(slots, prompts, params, [i in pre for i in range(len(prompts))])
    except BaseException:  # taking rows in failed partway: none of them stays taken
        for b in slots:
            state.release(b)
        raise
    if pre:
        target = ctx.model
        scored = {
            i: PromptLogprobs(target, prompts[i], params[i].prompt_logprobs) for i in pre if not reuse[i]
        }
        waves = sorted({plans[i].wave for i in pre})
        adm = Admission(slots, prompts, params, plans, list(pre), scored, waves)
        state.pending.append(adm)
        if wait:
            try:
                advance(ctx, state, None)
            except BaseException:  # this call raises, so its caller never learns its slots: none stays taken
                if adm in state.pending:  # (an older admission's prefill failed before this one ran)
                    state.pending.remove(adm)
                for b in slots:
                    if state.outs[b] is not None:
                        state.filled[b] = False  # what its prefill wrote, if anything, is unknown
                        state.release(b)
                raise
            # its own rows are the caller's (returned); older admissions' rows stay for the next step
            state.unreported = [b for b in state.unreported if b not in slots]
    return slots


def advance(ctx: DecodeContext, state: BatchState, budget: int | None) -> None:
    """Prefill forwards of the pending admissions, oldest first, until `budget` positions ran (None: all of
    them; at least one forward); the slots whose prefill ended (live now, or finished: prompt logprobs only)
    go to `state.unreported` as they end, for the next step to report (kept when a later forward fails). A
    failure frees the failing admission's unfinished rows and raises."""
    if not state.pending:
        return
    state.unpark()
    spent = 0
    while state.pending:
        adm = state.pending[0]
        try:
            if adm.job is None or adm.job.finished:
                if not adm.waves:
                    state.pending.pop(0)
                else:
                    _start_wave(ctx, state, adm)
                continue
            cost = adm.job.cost()
            if budget is not None and spent and spent + cost > budget:
                break
            ended = adm.job.forward()
            spent += cost
            state.unreported += _ended(ctx, state, adm, [adm.now[j] for j in ended])
        except BaseException:  # a failed prefill (out of memory, say) must not keep its rows forever
            state.pending.remove(adm)
            for i in adm.todo:
                state.filled[adm.slots[i]] = False  # what it wrote of its row is unknown
                state.release(adm.slots[i])
            raise


def _start_wave(ctx: DecodeContext, state: BatchState, adm: Admission) -> None:
    """The next wave's copies (plan order: a row copied into earlier may be a source) and its `Prefill`."""
    wave = adm.waves.pop(0)
    adm.now = [i for i in adm.todo if adm.plans[i].wave == wave]
    for i in adm.now:
        if (r := adm.plans[i]).src is not None:
            ctx.cache.copy(r.src, r.slot, r.have, r.keep)
            if ctx.dcache is not None:
                ctx.dcache.copy(r.src, r.slot, r.have, r.keep)
    now = adm.now

    def each(j: int, h: torch.Tensor, first: int) -> None:
        if now[j] in adm.scored:
            adm.scored[now[j]].add(h, first)

    adm.job = None
    if now:
        rows, starts = [adm.slots[i] for i in now], [adm.plans[i].keep for i in now]
        prompts = [adm.prompts[i] for i in now]
        aux = state.spec.method != "ar"
        adm.job = Prefill(ctx.models(), prompts, rows, aux, starts, ctx.chunk, each)


def _ended(ctx: DecodeContext, state: BatchState, adm: Admission, idx: list[int]) -> list[int]:
    """Prompts whose prefill just ended: their rows hold them, prompt logprobs are read, rows that generate
    get their first token and go live, the others finish."""
    slots = [adm.slots[i] for i in idx]
    for i, b in zip(idx, slots):
        adm.todo.remove(i)
        state.filled[b] = True
        state.outs[b].cached_tokens = adm.plans[i].keep
        if i in adm.scored:
            state.outs[b].prompt_logprobs = adm.scored[i].result()
    go = [i for i in idx if adm.params[i].max_tokens > 0]
    for i in idx:
        if adm.params[i].max_tokens == 0:
            state.finish(adm.slots[i], "length")
    if go:
        rows = [adm.slots[i] for i in go]
        state.live += rows
        state.rs = None
        rs, dev = state.sampling(rows), ctx.device
        h = torch.stack([adm.job.last[adm.now.index(i)] for i in go])
        tok, lp = ctx.models().next_token(h, rs.rows(torch.tensor(rows, device=dev)))
        at = torch.tensor(rows, device=dev)
        state.lens[at] = torch.tensor([len(adm.prompts[i]) for i in go], device=dev)
        state.bonus[at], state.alive[at] = tok, True
        lps = lp and lp.cpu()
        state.emit(rows, {b: [t] for b, t in zip(rows, tok.tolist())}, lps, dict(zip(rows, range(len(rows)))))
    return slots
