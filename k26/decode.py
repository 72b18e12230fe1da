"""Decoding a batch of rows that come and go: autoregressive, DFlash or DDTree, eager or one CUDA-graph
replay per step.

A `BatchState` holds the rows of one batch (cache row = slot): their outputs, lengths, bonus tokens, stop
sets, sampling parameters and generators. The `Decoder` admits prompts into free slots (their prefill
runs between steps), advances every live row by one step (eager, or a graph replay), emits the tokens
each row accepted, and retires rows that finish or are released. `run` drives one fixed batch to the end
(`LLM.generate` / `stream`); the server's engine thread calls `admit` / `step` / `release` itself
(continuous batching).

Graph mode: per method and sampling mode (`sampling.MODES`: greedy; sampled; sampled with top-p / top-k,
which sorts the vocabulary; that plus logprobs) a `StepGraphs` (per-row sampling tensors, so any mix of
requests shares one graph) captures the whole step per bucket before the first prefill (the caches are
scratch then); each step replays the cheapest mode that serves the live rows (host-known); the host loop
is replay, one small copy of the emitted tokens back, bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .dist import shared_seed
from .graphs import Bucket, StepGraphs, pick_bucket
from .graphs.stepper import DecodeGraphs, GraphStepper
from .kv_cache import DrafterCache, LatentCache
from .model import KimiK2
from .model.drafter import DFlashDrafter
from .outputs import RequestOutput
from .sampling import MODES, RowSampling, SamplingParams, StepLogprobs, sampling_mode
from .spec.budget import BudgetPolicy, Budgets, timing_contexts
from .spec.step import (
    SpecConfig,
    StepModels,
    Stepped,
    eager_ar_step,
    eager_speculative_step,
    prefill,
    prompt_logprobs,
    time_step,
    verify_nodes,
)
from .spec.timer import PhaseTimer
from .spec.tree import TreeTables
from .tokenizer import TextStream, Tokenizer, first_stop


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


@dataclass
class BatchState:
    """The rows of one batch and their bookkeeping: admission, emitted tokens, stops, stats, release. The
    device tensors are the graphs' static buffers in graph mode, so the host writes admitted and retired
    rows straight into what the next replay reads."""

    spec: SpecConfig
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
    outs: list[RequestOutput | None] = field(init=False)  # per slot, sized by __post_init__
    params: list[SamplingParams | None] = field(init=False)
    stops: list[frozenset[int]] = field(init=False)
    texts: list[TextStream | None] = field(init=False)  # rows with stop strings: their text as it grows
    gens: list[torch.Generator | None] = field(init=False)
    live: list[int] = field(default_factory=list)
    timer: PhaseTimer | None = None
    rs: RowSampling | None = None  # eager: rebuilt when rows come or go

    def __post_init__(self) -> None:
        cap = self.capacity
        self.outs, self.params, self.gens = [None] * cap, [None] * cap, [None] * cap
        self.stops = [frozenset()] * cap
        self.texts = [None] * cap

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

    def add(self, slots: list[int], prompts: list[list[int]], params: list[SamplingParams]) -> list[int]:
        """Take requests into `slots`; rows with max_tokens 0 finish at once, the others become live (their
        prefill is the caller's). Returns the live ones."""
        no_lp = self.graph is not None and "logprobs" not in self.graph.runners
        if no_lp and any(p.logprobs is not None for p in params):
            raise ValueError(
                "SamplingParams.logprobs: this batch has no logprobs graphs (open_batch(logprobs=False))"
            )
        dev = self.lens.device
        for b, p, sp in zip(slots, prompts, params):
            self.outs[b], self.params[b] = RequestOutput(p, logprobs=None if sp.logprobs is None else []), sp
            self.stops[b] = frozenset(
                sp.stop_token_ids if sp.stop_token_ids is not None else self.tokenizer.stop_ids
            )
            self.gens[b] = None if sp.seed is None else torch.Generator(device=dev).manual_seed(sp.seed)
            self.texts[b] = TextStream(self.tokenizer) if sp.stop else None
            if self.graph is not None:  # the per-row sampling the captured step reads
                st = self.graph.state
                st.temperature[b], st.top_p[b], st.top_k[b] = float(sp.temperature), float(sp.top_p), sp.top_k
        self.rs = None
        go = [b for b, sp in zip(slots, params) if sp.max_tokens > 0]
        if self.policy is not None:
            self.policy.admit(go)
        for b, sp in zip(slots, params):
            if sp.max_tokens == 0:
                self.finish(b, "length")
        self.live += go
        return go

    def release(self, slot: int) -> RequestOutput | None:
        """Free a slot (a finished row, or a cancelled request: its row stops at the next step)."""
        out = self.outs[slot]
        if slot in self.live:
            self.live.remove(slot)
        self.alive[slot] = False
        self.outs[slot] = self.params[slot] = self.gens[slot] = self.texts[slot] = None
        self.rs = None
        return out

    def sampling(self, rows: list[int], nodes: int | None = None) -> RowSampling:
        """The batch's per-row sampling, with fresh noise for `rows` when any live row samples."""
        sampled = [b for b in rows if self.params[b].temperature > 0]
        if self.graph is not None:
            st = self.graph.state
            rs = RowSampling.in_mode(self.mode, st.temperature, st.top_p, st.top_k, st.noise)
        else:
            if self.rs is None:  # live rows only: a finished, unreleased row must not turn sampling on
                live = [self.params[b] if b in self.live else None for b in range(self.capacity)]
                self.rs = RowSampling.of(live, self.lens.device)
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
        asked."""
        for b in rows:
            o, sp = self.outs[b], self.params[b]
            lps = None if o.logprobs is None else lp.row(at[b] if at else b, len(new[b]), sp.logprobs)
            for j, t in enumerate(new[b]):
                if t in self.stops[b]:
                    self.finish(b, "stop")
                    break
                o.token_ids.append(t)
                if lps is not None:
                    o.logprobs.append(lps[j])
                if (ts := self.texts[b]) is not None:
                    new_chars = len(ts.push([t]))  # only they can complete a stop string
                    if (cut := first_stop(ts.text, sp.stop, new_chars)) is not None:
                        self.finish(b, "stop", text=ts.text[:cut])
                        break
                if (
                    len(o.token_ids) >= sp.max_tokens
                    or len(o.prompt_token_ids) + len(o.token_ids) >= self.max_model_len
                ):
                    self.finish(b, "length")
                    break

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


class Decoder:
    """Admits, steps and retires the rows of `BatchState`s on the injected models and caches."""

    def __init__(self, ctx: DecodeContext):
        self.ctx = ctx
        self.budgets = Budgets(ctx.device, graphs=ctx.graphs)
        self.step_graphs = DecodeGraphs(
            lambda: ctx.models(ctx.target),
            ctx.device,
            ctx.block,
            ctx.model.cfg.vocab_size,
            lambda spec, batch: self.budgets.policies.get((spec, batch)),
        )

    @property
    def policies(self) -> dict[tuple, BudgetPolicy]:
        """The adaptive budget's policies, per (SpecConfig, batch size)."""
        return self.budgets.policies

    @property
    def runners(self) -> dict[tuple, StepGraphs]:
        """The captured step graphs, per (SpecConfig, sampling mode)."""
        return self.step_graphs.runners

    def _runner(self, spec: SpecConfig, mode: str) -> StepGraphs:
        return self.step_graphs.runner(spec, mode)

    def open(self, spec: SpecConfig, capacity: int, kinds: tuple[str, ...] = MODES) -> BatchState:
        """An empty batch of `capacity` rows (graphs: the smallest bucket that holds them), with its graphs
        captured (`kinds`: the sampling modes its rows may need, `sampling.MODES`) and the adaptive
        budget's costs measured, before any prefill: both run on the caches as scratch."""
        ctx = self.ctx
        nodes, graph, cap = verify_nodes(spec, ctx.block), None, capacity
        if ctx.graphs:
            fit = pick_bucket(ctx.buckets_for(spec), capacity, nodes)
            cap = fit.batch
        policy = self.budgets.policy(spec, cap) if spec.auto else None  # before capture: the graphs read it
        if ctx.graphs:
            graph = self.step_graphs.stepper(spec, fit, kinds, progress=ctx.progress)
            nodes = graph.nodes
        if policy is not None:
            self._calibrate(spec, cap, graph)
        return self._empty(spec, cap, nodes, graph, policy)

    def _calibrate(self, spec: SpecConfig, batch: int, graph: GraphStepper | None) -> None:
        """The adaptive budget's costs of (spec, batch), timed on graph replays or eager steps."""
        ctx = self.ctx
        if graph is not None:
            time_at = graph.time_buckets
        else:
            time_at = lambda at: [time_step(ctx.models(), spec.fixed(c), batch, at) for c in spec.candidates]
        ats = timing_contexts(ctx.max_model_len, spec.candidates[-1], ctx.drafter.cfg.block_size)
        self.budgets.calibrate(spec, batch, time_at, ats, all_ranks=ctx.tp_size > 1)

    def _empty(self, spec, cap: int, nodes: int, graph: GraphStepper | None, policy) -> BatchState:
        """A batch of `cap` free rows: the graphs' static buffers (reset), else fresh tensors."""
        ctx, dev = self.ctx, self.ctx.device
        if graph is not None:
            st = graph.state
            st.reset()
            lens, bonus, alive, noise = st.start, st.bonus, st.alive, st.noise
        else:
            z = torch.zeros(cap, dtype=torch.long, device=dev)
            lens, bonus, alive, noise = z, z.clone(), torch.zeros(cap, dtype=torch.bool, device=dev), None
        seed = shared_seed(dev) if ctx.tp_size > 1 else int(torch.randint(0, 2**62, ()))
        timer = PhaseTimer(dev) if spec.method != "ar" and graph is None else None
        shared = torch.Generator(device=dev).manual_seed(seed)
        limits = (ctx.room(nodes), ctx.tokenizer, ctx.max_model_len, ctx.model.cfg.vocab_size)
        return BatchState(spec, lens, bonus, alive, shared, noise, nodes, *limits, graph, policy, timer=timer)

    def admit(self, state: BatchState, prompts: list[list[int]], params: list[SamplingParams]) -> list[int]:
        """Put prompts into free slots, prefill them together and emit their first token; returns the
        slots (the caller checked there are enough)."""
        slots = state.free_slots()[: len(prompts)]
        try:
            go = state.add(slots, prompts, params)
            # prompt logprobs: the prefill's every position (also for a row that generates nothing)
            scored = {b: sp.prompt_logprobs for b, sp in zip(slots, params) if sp.prompt_logprobs is not None}
            pre = [b for b in slots if b in go or b in scored]
            if not pre:
                return slots
            m, dev = self.ctx.models(), self.ctx.device
            ids = [state.outs[b].prompt_token_ids for b in pre]
            h, lens = prefill(m, ids, torch.tensor(pre, device=dev), state.spec.method != "ar")
            for i, b in enumerate(pre):
                if b in scored:
                    lps = prompt_logprobs(m.target, h[i, : len(ids[i])], ids[i], scored[b])
                    state.outs[b].prompt_logprobs = [None, *lps]
            if not go:
                return slots
            rows, at = torch.tensor(go, device=dev), torch.tensor([pre.index(b) for b in go], device=dev)
            rs = state.sampling(go)
            h, lens = h[at, lens[at] - 1], lens[at]
            tok, lp = m.next_token(h, rs.rows(rows))
            state.lens[rows], state.bonus[rows], state.alive[rows] = lens, tok, True
            state.emit(
                go, {b: [t] for b, t in zip(go, tok.tolist())}, lp and lp.cpu(), dict(zip(go, range(len(go))))
            )
        except BaseException:  # a failed prefill (out of memory, say) must not keep its rows forever
            for b in slots:
                state.release(b)
            raise
        return slots

    def release(self, state: BatchState, slot: int) -> RequestOutput | None:
        """Free a slot (a finished row, or a cancelled request: its row stops at the next step)."""
        return state.release(slot)

    def step(self, state: BatchState) -> list[int]:
        """Advance every live row by one step; returns the rows that stepped (their outputs grew)."""
        was = list(state.live)
        room = state.spec.method == "ar" or state.has_room()
        rs = state.sampling(was, nodes=1 if not room else None)
        if state.graph is not None and room:
            stepped = state.graph(state.mode)
        else:
            s, m, rows = state, self.ctx.models(), torch.arange(state.capacity, device=self.ctx.device)
            if room and s.spec.method != "ar":
                args = (s.lens, s.bonus, s.alive, s.spec, rs, s.timer, s.policy)
                stepped = eager_speculative_step(m, rows, *args)
            else:  # AR, or no room for another verify tree: this step decodes one token like AR
                spec = s.spec.method != "ar"  # (then the drafter's context still follows)
                stepped = eager_ar_step(m, rows, s.lens, s.bonus, s.alive, rs, context=spec)
        self.ctx.model.tp.check()  # a peer that died mid-step: its error, not the garbage tokens it left
        state.record(was, stepped)
        return was

    def run(
        self, prompts: list[list[int]], sp: SamplingParams, spec: SpecConfig
    ) -> Iterator[list[RequestOutput]]:
        """One fixed batch from prefill to the end, yielding the outputs after every step."""
        state = self.open(spec, len(prompts), kinds=(sampling_mode([sp]),))
        self.admit(state, prompts, [sp] * len(prompts))
        outs = state.outs[: len(prompts)]
        yield outs
        while state.live:
            self.step(state)
            yield outs
