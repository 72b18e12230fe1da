"""Decoding a batch of rows that come and go: autoregressive, DFlash or DDTree, eager or one CUDA-graph
replay per step.

A `BatchState` (batch_state.py) holds the rows of one batch (cache row = slot): their outputs, lengths,
bonus tokens, stop sets, sampling parameters and generators. The `Decoder` admits prompts into free slots
(`admission.py`: each where the most of it is cached, the rest prefilled between steps), advances every
live row by one step (eager, or a graph replay), emits the tokens each row accepted, and retires rows
that finish or are released. `run` drives one fixed batch to the end (`LLM.generate` / `stream`); the
server's engine thread calls `admit` / `step` / `release` itself (continuous batching).

Graph mode: per method and sampling mode (`sampling.MODES`: greedy; sampled; sampled with top-p / top-k,
which sorts the vocabulary; that plus logprobs) a `StepGraphs` (per-row sampling tensors, so any mix of
requests shares one graph) captures the whole step per bucket before the first prefill (the caches are
scratch then); each step replays the cheapest mode that serves the live rows (host-known); the host loop
is replay, one small copy of the emitted tokens back, bookkeeping.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .admission import admit, advance
from .batch_state import BatchState
from .decode_context import DecodeContext
from .dist import shared_seed
from .graphs import StepGraphs, pick_bucket
from .graphs.stepper import DecodeGraphs, GraphStepper
from .kv_cache import HeadStash
from .outputs import RequestOutput
from .sampling import MODES, SamplingParams, sampling_mode
from .spec.budget import BudgetPolicy, Budgets, timing_contexts
from .spec.step import SpecConfig, eager_ar_step, eager_speculative_step, time_step, verify_nodes
from .spec.timer import PhaseTimer


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
        return self._empty(spec, cap, nodes, graph, policy, kinds)

    def _calibrate(self, spec: SpecConfig, batch: int, graph: GraphStepper | None) -> None:
        """The adaptive budget's costs of (spec, batch), timed on graph replays or eager steps."""
        ctx = self.ctx
        if graph is not None:
            time_at = graph.time_buckets
        else:
            time_at = lambda at: [time_step(ctx.models(), spec.fixed(c), batch, at) for c in spec.candidates]
        ats = timing_contexts(ctx.max_model_len, spec.candidates[-1], ctx.drafter.cfg.block_size)
        self.budgets.calibrate(spec, batch, time_at, ats, all_ranks=ctx.tp_size > 1)

    def _empty(
        self, spec, cap: int, nodes: int, graph: GraphStepper | None, policy, kinds: tuple[str, ...]
    ) -> BatchState:
        """A batch of `cap` free rows: the graphs' static buffers (reset), else fresh tensors."""
        ctx, dev = self.ctx, self.ctx.device
        if graph is not None:
            st = graph.state
            st.reset()
            rows, lens, bonus, alive, noise = st.rows, st.start, st.bonus, st.alive, st.noise
        else:
            z = torch.zeros(cap, dtype=torch.long, device=dev)
            rows, lens, bonus = torch.arange(cap, device=dev), z, z.clone()
            alive, noise = torch.zeros(cap, dtype=torch.bool, device=dev), None
        seed = shared_seed(dev) if ctx.tp_size > 1 else int(torch.randint(0, 2**62, ()))
        timer = PhaseTimer(dev) if spec.method != "ar" and graph is None else None
        shared = torch.Generator(device=dev).manual_seed(seed)
        limits = (ctx.room(nodes), ctx.tokenizer, ctx.max_model_len, ctx.model.cfg.vocab_size)
        stash = None
        if spec.method != "ar":  # idle slots write the parking row from position 0: the verify's nodes and
            # the commit's path (one longer than the deepest draft)
            stash = HeadStash([ctx.cache.kv_LRTC], max(nodes, ctx.block))  # (their drafter writes: trash row)
        state = BatchState(
            spec,
            rows,
            lens,
            bonus,
            alive,
            shared,
            noise,
            nodes,
            *limits,
            graph,
            policy,
            kinds,
            timer=timer,
            stash=stash,
        )
        state.prefix.enabled = ctx.prefix_cache
        return state

    def admit(
        self, state: BatchState, prompts: list[list[int]], params: list[SamplingParams], wait: bool = True
    ) -> list[int]:
        """Put prompts into free slots where the most of each is cached, prefill the rest and emit their
        first token (`admission.admit`; `wait` False: the prefill runs in the next steps, a budget of
        positions per step); returns the slots (the caller checked there are enough)."""
        return admit(self.ctx, state, prompts, params, wait)

    def release(self, state: BatchState, slot: int) -> RequestOutput | None:
        """Free a slot (a finished row, or a cancelled request: its row stops at the next step)."""
        return state.release(slot)

    def step(self, state: BatchState) -> list[int]:
        """Advance every live row by one step, after a budget of pending prefill positions (all of them when
        no row is live: nothing waits on it); returns the rows whose outputs grew or that finished (and those
        whose prefill ended since the last step, in a waiting `admit` for earlier admissions too)."""
        advance(self.ctx, state, self.ctx.prefill_budget if state.live else None)
        ready, state.unreported = state.unreported, []  # (after advance: a failing prefill keeps them)
        if not state.live:
            return ready
        was = list(state.live)
        if state.spec.method != "ar":  # idle slots run at position 0 of their row: the parking row's
            state.park()
        room = state.spec.method == "ar" or state.has_room()
        rs = state.sampling(was, nodes=1 if not room else None)
        if state.graph is not None and room:
            stepped = state.graph(state.mode)
        else:
            s, m, rows = state, self.ctx.models(), state.rows
            if room and s.spec.method != "ar":
                args = (s.lens, s.bonus, s.alive, s.spec, rs, s.timer, s.policy)
                stepped = eager_speculative_step(m, rows, *args)
            else:  # AR, or no room for another verify tree: this step decodes one token like AR
                spec = s.spec.method != "ar"  # (then the drafter's context still follows)
                stepped = eager_ar_step(m, rows, s.lens, s.bonus, s.alive, rs, context=spec)
        self.ctx.model.tp.check()  # a peer that died mid-step: its error, not the garbage tokens it left
        state.record(was, stepped)
        return was + [b for b in ready if b not in was]

    def run(
        self, prompts: list[list[int]], sp: SamplingParams, spec: SpecConfig
    ) -> Iterator[list[RequestOutput]]:
        """One fixed batch from prefill to the end, yielding the outputs after every step. Seeded sampling
        starts the adaptive budget afresh (the measured costs kept): what earlier calls taught it would change
        the trees, and so the seeded tokens, from one identical call to the next. Other calls keep learning
        (greedy tokens do not depend on the trees; `k26 bench` times a budget warmed by its first run)."""
        state = self.open(spec, len(prompts), kinds=(sampling_mode([sp]),))
        if state.policy is not None and sp.seed is not None and sp.temperature > 0:
            state.policy.reset()
        slots = self.admit(state, prompts, [sp] * len(prompts))
        outs = [state.outs[b] for b in slots]
        yield outs
        while state.live:
            self.step(state)
            yield outs
