"""Admission of prompts into a batch between steps: each prompt's row and cached prefix
(`PrefixCache.plan`), the copies of cached prefixes between rows, the prefill of the rest (one forward per
chunk and wave), prompt logprobs, and each row's first token."""

from __future__ import annotations

import torch

from .batch_state import BatchState
from .decode_context import DecodeContext
from .sampling import SamplingParams
from .spec.prefill import PromptLogprobs, prefill


def admit(
    ctx: DecodeContext, state: BatchState, prompts: list[list[int]], params: list[SamplingParams]
) -> list[int]:
    """Put prompts into free slots, each where the most of it is cached (`PrefixCache.plan`: a row that
    holds a prefix, or a copy from one), prefill the rest of them together (one forward per chunk and
    wave) and emit their first token; returns the slots (the caller checked there are enough)."""
    dev = ctx.device
    state.unpark()  # every row holds what the prefix cache says it holds
    # prefilled: rows that generate, and rows asking for prompt logprobs
    pre = [i for i, sp in enumerate(params) if sp.max_tokens > 0 or sp.prompt_logprobs is not None]
    asked = [None if i not in pre else p for i, p in enumerate(prompts)]
    reuse = [sp.prompt_logprobs is None for sp in params]  # prompt logprobs: every position runs
    plans = state.prefix.plan(asked, state.free_slots(), state.held(), reuse)
    slots = [r.slot for r in plans]
    try:
        go = state.add(slots, prompts, params)
        if not pre:
            return slots
        m, aux = ctx.models(), state.spec.method != "ar"
        scored = {
            i: PromptLogprobs(m.target, prompts[i], params[i].prompt_logprobs) for i in pre if not reuse[i]
        }
        last: dict[int, torch.Tensor] = {}
        for wave in sorted({plans[i].wave for i in pre}):
            now = [i for i in pre if plans[i].wave == wave]
            for i in now:  # in plan order: a row copied into earlier in this wave may be a source
                if (r := plans[i]).src is not None:
                    ctx.cache.copy(r.src, r.slot, r.have, r.keep)
                    if ctx.dcache is not None:
                        ctx.dcache.copy(r.src, r.slot, r.have, r.keep)

            def each(j: int, h: torch.Tensor, first: int, now=now) -> None:
                if now[j] in scored:
                    scored[now[j]].add(h, first)

            starts = [plans[i].keep for i in now]
            h = prefill(m, [prompts[i] for i in now], [slots[i] for i in now], aux, starts, ctx.chunk, each)
            last.update(zip(now, h))
            for i in now:
                state.filled[slots[i]] = True
                state.outs[slots[i]].cached_tokens = plans[i].keep
        for i, lp in scored.items():
            state.outs[slots[i]].prompt_logprobs = lp.result()
        if not go:
            return slots
        first = [slots.index(b) for b in go]
        rows = torch.tensor(go, device=dev)
        rs = state.sampling(go)
        tok, lp = m.next_token(torch.stack([last[i] for i in first]), rs.rows(rows))
        lens = torch.tensor([len(prompts[i]) for i in first], device=dev)
        state.lens[rows], state.bonus[rows], state.alive[rows] = lens, tok, True
        state.emit(
            go, {b: [t] for b, t in zip(go, tok.tolist())}, lp and lp.cpu(), dict(zip(go, range(len(go))))
        )
    except BaseException:  # a failed prefill (out of memory, say) must not keep its rows forever
        for b in slots:
            state.filled[b] = False  # what it wrote of its row is unknown
            state.release(b)
        raise
    return slots
