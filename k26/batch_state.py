"""The rows of one decoding batch and their bookkeeping: admission, emitted tokens, stops, stats, release,
and what each cache row holds for the next prompt (`prefix_cache.PrefixCache`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .graphs.stepper import GraphStepper
from .kv_cache import HeadStash
from .outputs import RequestOutput
from .penalties import Penalties, RowPenalty
from .prefix_cache import PrefixCache, cached_tokens
from .sampling import MODES, RowSampling, SamplingParams, StepLogprobs, sampling_mode, seeded_generator
from .spec.budget import BudgetPolicy
from .spec.step import SpecConfig, Stepped
from .spec.timer import PhaseTimer
from .tokenizer import TextStream, Tokenizer, first_stop


@dataclass
class BatchState:
    """The rows of one batch and their bookkeeping: admission, emitted tokens, stops, stats, release. The
    device tensors are the graphs' static buffers in graph mode, so the host writes admitted and retired
    rows straight into what the next replay reads. `rows[b]`: the cache row slot b runs in (its own while
    it holds a live request; idle slots of a speculative batch all run in the parking row)."""

    spec: SpecConfig
    rows: torch.Tensor  # [cap] cache row per slot
    lens: torch.Tensor  # [cap] committed length per row
    bonus: torch.Tensor  # [cap] next root token
    alive: torch.Tensor  # [cap] bool
    shared: torch.Generator  # draws of sampled rows without a seed of their own
    noise: torch.Tensor | None  # [cap, nodes, V] Exp(1) draws (sampled rows), allocated when first needed
    nodes: int  # verify tokens a step may write past a row's length
    room: int  # the longest sequence that still has cache room for a speculative step (DecodeContext.room)
    tokenizer: Tokenizer  # decodes the outputs' text
    max_model_len: int
    vocab: int
    graph: GraphStepper | None = None
    policy: BudgetPolicy | None = None
    modes: tuple[str, ...] = MODES  # the sampling modes its rows may need (graphs: those captured)
    outs: list[RequestOutput | None] = field(init=False)  # per slot, sized by __post_init__
    params: list[SamplingParams | None] = field(init=False)
    stops: list[frozenset[int]] = field(init=False)
    texts: list[TextStream | None] = field(init=False)  # rows with stop strings: their text as it grows
    seek_from: list[int] = field(init=False)  # where in texts[b] a stop string must end after (min_tokens)
    gens: list[torch.Generator | None] = field(init=False)
    live: list[int] = field(default_factory=list)
    timer: PhaseTimer | None = None
    rs: RowSampling | None = None  # eager: rebuilt when rows come or go
    penalties: Penalties | None = None  # eager: the rows' penalties, allocated with the first such row
    stash: HeadStash | None = None  # speculative batches: the parking row's first `nodes` positions
    pending: list = field(default_factory=list)  # `admission.Admission`s still being prefilled, oldest first
    # rows whose prefill ended (`admission.advance`) not yet reported: the next `Decoder.step` reports them (a
    # waiting `admit` takes its own out: it returns them)
    unreported: list[int] = field(default_factory=list)
    prefix: PrefixCache = field(init=False)  # what each cache row holds, for the next prompts
    filled: list[bool] = field(init=False)  # the slot's prompt was prefilled into its row
    row_of: list[int] | None = field(init=False)  # `rows` as the host last wrote it (eager: its own tensor)
    # target forwards of rows since the batch opened, and the tokens they emitted (prefill's first tokens not
    # among them): the server's tau is their ratio, as each output's SpecStats.tau
    forward_rows: int = 0
    forward_tokens: int = 0

    def __post_init__(self) -> None:
        cap = self.capacity
        self.outs, self.params, self.gens = [None] * cap, [None] * cap, [None] * cap
        self.stops = [frozenset()] * cap
        self.texts = [None] * cap
        self.seek_from = [0] * cap
        self.prefix = PrefixCache(cap)
        self.filled = [False] * cap
        self.row_of = list(range(cap))

    @property
    def capacity(self) -> int:
        return self.lens.shape[0]

    def free_slots(self) -> list[int]:
        return [b for b in range(self.capacity) if self.outs[b] is None]

    @property
    def mode(self) -> str:
        """The cheapest sampling mode (`sampling.MODES`) that serves every live row."""
        return sampling_mode(self.params[b] for b in self.live)

    def has_room(self) -> bool:
        """Whether every live row still has cache room for a speculative step."""
        lengths = (len(self.outs[b].prompt_token_ids) + len(self.outs[b].token_ids) for b in self.live)
        return max(lengths, default=0) <= self.room

    def check_params(self, params: list[SamplingParams]) -> None:
        """ValueError for a request this batch's sampling modes cannot serve, before any row or rank acts on
        it (under TP a refusal after the ranks were told left them out of step)."""
        # (eager batches hold the same rule as graphed ones: open_batch(logprobs=False) on a CPU refused
        # nothing and accepted a row its GPU twin refuses)
        if "logprobs" not in self.modes and any(p.logprobs is not None for p in params):
            raise ValueError(
                "SamplingParams.logprobs: this batch has no logprobs graphs (open_batch(logprobs=False))"
            )
        if any(p.penalized for p in params) and not {"filter", "logprobs"} & set(self.modes):
            raise ValueError(
                "SamplingParams penalties / logit_bias: this batch has no graphs of the 'filter' "
                "sampling mode"
            )

    def add(
        self, slots: list[int], prompts: list[list[int]], params: list[SamplingParams], prefilled: list[bool]
    ) -> None:
        """Take requests into `slots`; rows that are not `prefilled` (max_tokens 0, no prompt logprobs) finish
        at once, the others go live once their prefill ends (`admission.py`)."""
        self.check_params(params)
        if any(p.penalized for p in params) and self.graph is None and self.penalties is None:
            self.penalties = Penalties.allocate(self.capacity, self.vocab, self.lens.device)
        dev = self.lens.device
        for adm in self.pending:  # copies still to come from these rows read what they held: not any more
            for b in slots:
                adm.source_lost(b)
        for b, p, sp in zip(slots, prompts, params):
            self.outs[b], self.params[b] = RequestOutput(p, logprobs=None if sp.logprobs is None else []), sp
            self.stops[b] = frozenset(
                sp.stop_token_ids if sp.stop_token_ids is not None else self.tokenizer.stop_ids
            )
            self.gens[b] = None if sp.seed is None else seeded_generator(sp.seed, dev)
            self.texts[b] = TextStream(self.tokenizer) if sp.stop else None
            self.seek_from[b] = 0
            self.prefix.admitted(b)
            if self.graph is not None:  # the per-row sampling the captured step reads
                st = self.graph.state
                st.temperature[b], st.top_p[b], st.top_k[b] = float(sp.temperature), float(sp.top_p), sp.top_k
            # every new row, penalised or not: the slot's last request leaves nothing behind
            if (pen := self.penalty_state) is not None:
                pen.set_row(
                    b,
                    # min_tokens holds the end ids back too (vLLM's, whatever ignore_eos says)
                    RowPenalty(
                        sp.frequency_penalty,
                        sp.presence_penalty,
                        sp.logit_bias,
                        sp.min_tokens,
                        self.stops[b] | frozenset(self.tokenizer.stop_ids),
                    ),
                )
        self.rs = None
        # until a row goes live its idle steps write at its length (autoregressive batches): past its prompt,
        # never into what its prefill writes or what it holds afterwards
        # (dtype given: no slots at all must still index as long, not as an empty float tensor)
        at = torch.tensor(slots, dtype=torch.long, device=dev)
        self.lens[at] = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        if self.policy is not None:
            self.policy.admit([b for b, sp in zip(slots, params) if sp.max_tokens > 0])
        for b, go in zip(slots, prefilled):
            if not go:
                self.finish(b, "length")

    def release(self, slot: int) -> RequestOutput | None:
        """Free a slot (a finished row, or a cancelled request: its row stops at the next step)."""
        out = self.outs[slot]
        for adm in self.pending:  # still being prefilled: it runs no further
            adm.cancel(slot)
        # an admission with no prompt left is done (its prefill job and hidden states go with it): else a
        # batch whose every row was released would still count as unfinished
        self.pending[:] = [adm for adm in self.pending if adm.todo]
        if slot in self.unreported:
            self.unreported.remove(slot)
        if slot in self.live:
            self.live.remove(slot)
        self.alive[slot] = False
        if out is not None:
            held = cached_tokens(out.prompt_token_ids, out.token_ids) if self.filled[slot] else []
            self.prefix.released(slot, held)
        ts = self.texts[slot]
        self.filled[slot] = False
        self.outs[slot] = self.params[slot] = self.gens[slot] = self.texts[slot] = None
        self.rs = None
        if out is not None and out.finish_reason is None:  # cancelled before it finished (its row freed
            # first, whatever the decode does): its text so far, said as aborted
            tok = self.tokenizer
            out.text = ts.finish() if ts is not None else tok.decode(out.token_ids, skip_special=True)
            out.finish_reason = "abort"
        return out

    def overwritten(self) -> None:
        """Something else wrote into the caches (`LLM.score` / `generate` / `stream`): no row holds anything
        the prefix cache may count on, occupied ones included."""
        self.prefix.clear()
        self.filled = [False] * self.capacity
        if self.stash is not None:
            self.stash.row = None  # what it holds is stale too
        self.prefix.parked = None

    def held(self) -> dict[int, list[int]]:
        """The tokens each occupied slot's cache row holds (for `PrefixCache.plan`)."""
        return {
            b: cached_tokens(o.prompt_token_ids, o.token_ids)
            for b, o in enumerate(self.outs)
            if o is not None and self.filled[b]
        }

    def park(self) -> None:
        """Before a speculative step: idle slots run in the parking row (`PrefixCache.park`), whose first
        positions, all they write, are kept aside (`stash`), so no row loses what it holds."""
        idle = [b for b in range(self.capacity) if b not in self.live]
        p = self.prefix.park(idle, self.free_slots())
        if p is not None and self.stash is not None and self.stash.row != p:
            self.stash.save(p)
        want = [b if b in self.live or p is None else p for b in range(self.capacity)]
        # graphs: every batch of a bucket shares the static `rows` (another batch may have written it since)
        owner = self.graph.state if self.graph is not None else self
        if want != owner.row_of:
            self.rows.copy_(torch.tensor(want))
            owner.row_of = want

    def unpark(self) -> None:
        """Before an admission reads or writes rows: the parking row's first positions put back (the next
        step parks again)."""
        if self.stash is not None:
            self.stash.restore()
        self.prefix.parked = None

    @property
    def penalty_state(self) -> Penalties | None:
        """The rows' penalty tensors: the graphs' static ones, or the eager batch's own."""
        return self.graph.state.penalties if self.graph is not None else self.penalties

    def sampling(self, rows: list[int], nodes: int | None = None) -> RowSampling:
        """The batch's per-row sampling, with fresh noise for `rows` when any live row samples."""
        sampled = [b for b in rows if self.params[b].temperature > 0]
        if self.graph is not None:
            st = self.graph.state
            rs = RowSampling.in_mode(self.mode, st.temperature, st.top_p, st.top_k, st.noise, st.penalties)
        else:
            if self.rs is None:  # live rows only: a finished, unreleased row must not turn sampling on
                live = [self.params[b] if b in self.live else None for b in range(self.capacity)]
                self.rs = RowSampling.of(live, self.lens.device)
                self.rs.penalties = self.penalties if self.rs.filtered else None
            rs = self.rs
            if sampled and self.noise is None:
                self.noise = torch.empty(self.capacity, self.nodes, self.vocab, device=self.lens.device)
            rs.noise = self.noise if not rs.greedy else None
        if sampled:
            n = nodes or self.nodes
            for b in sampled:
                self.noise[b, :n].exponential_(1.0, generator=self.gens[b] or self.shared)
        return rs

    def record(self, rows: list[int], s: Stepped) -> None:
        """One step of `rows`: its stats, then its tokens (`emit`)."""
        self.forward_rows += len(rows)
        self.forward_tokens += sum(s.counts[b] for b in rows)
        for b in rows:
            st = self.outs[b].stats
            st.accepted_per_step.append(s.counts[b])
            st.steps += 1
            if s.budget is not None:
                st.budgets.append(s.budget)
        self.emit(rows, {b: s.tokens[b] for b in rows}, s.logprobs)

    def emit(
        self, rows: list[int], new: dict[int, list[int]], lp: StepLogprobs | None = None, at=None
    ) -> None:
        """Append each row's new tokens, stopping at a stop id / string, max_tokens or the context; `lp`
        (host; row `at[b]` is slot b's, default b): their logprobs (the "logprobs" mode), kept for rows that
        asked. The penalised rows' appended tokens are counted on the device for their next steps."""
        counted: tuple[list[int], list[int]] = ([], [])
        for b in rows:
            o, sp = self.outs[b], self.params[b]
            lps = None if o.logprobs is None else lp.row(at[b] if at else b, len(new[b]), sp.logprobs)
            for j, t in enumerate(new[b]):
                if t in self.stops[b]:
                    self.finish(b, "stop")
                    break
                o.token_ids.append(t)
                if sp.penalized:
                    counted[0].append(b), counted[1].append(t)
                if lps is not None:
                    o.logprobs.append(lps[j])
                if (ts := self.texts[b]) is not None:
                    new_chars = len(ts.push([t]))  # only they can complete a stop string
                    if len(o.token_ids) == sp.min_tokens:  # stop strings must end in what follows
                        self.seek_from[b] = len(ts.text)
                    seek = len(o.token_ids) > sp.min_tokens  # (vLLM's min_tokens)
                    if (
                        seek
                        and (cut := first_stop(ts.text, sp.stop, new_chars, self.seek_from[b])) is not None
                    ):
                        self.finish(b, "stop", text=ts.text[:cut])
                        break
                if (
                    len(o.token_ids) >= sp.max_tokens
                    or len(o.prompt_token_ids) + len(o.token_ids) >= self.max_model_len
                ):
                    self.finish(b, "length")
                    break
        if counted[0]:
            self.penalty_state.count(*counted)

    def finish(self, b: int, reason: str, text: str | None = None) -> None:
        """End row b; `text` is the output cut before a stop string (possibly empty), else the decode."""
        o = self.outs[b]
        o.finish_reason = reason
        if self.graph is not None:
            o.stats.host_s = self.graph.host_s
        elif self.timer is not None:  # batch-wide phase totals so far (one sync, at the end of a row)
            o.stats.draft_s, o.stats.verify_s = self.timer.total("draft"), self.timer.total("verify")
        if text is None:
            ts = self.texts[b]
            text = ts.finish() if ts is not None else self.tokenizer.decode(o.token_ids, skip_special=True)
        o.text = text
        if b in self.live:
            self.live.remove(b)
            self.alive[b] = False
