"""Decoding a batch of rows that come and go: autoregressive, DFlash or DDTree, eager or one CUDA-graph
replay per step.

A `BatchState` holds the rows of one batch (cache row = slot): their outputs, lengths, bonus tokens, stop
sets, sampling parameters and generators. The `Decoder` admits prompts into free slots (their prefill
runs between steps), advances every live row by one step (eager, or a graph replay), emits the tokens
each row accepted, and retires rows that finish or are released. `run` drives one fixed batch to the end
(`LLM.generate` / `stream`); the server's engine thread calls `admit` / `step` / `release` itself
(continuous batching).

Graph mode: per method a greedy and a sampled `StepGraphs` (per-row sampling tensors, so any mix of
requests shares one graph) capture the whole step per bucket before the first prefill (the caches are
scratch then); the host loop is replay, one small copy of the emitted tokens back, bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .graphs import Bucket, StepGraphs, pick_bucket
from .graphs.stepper import GraphStepper, graph_step
from .kv_cache import DrafterCache, LatentCache
from .model import AttnBatch, KimiK2
from .model.drafter import DFlashDrafter
from .profiling import nvtx_range
from .sampling import RowSampling, SamplingParams
from .spec.budget import BudgetPolicy, fit_costs, timing_contexts
from .spec.step import PhaseTimer, SpecConfig, StepModels, speculative_step, time_step, verify_nodes
from .spec.tree import TreeTables
from .tokenizer import Tokenizer


@dataclass
class SpecStats:
    accepted_per_step: list[int] = field(default_factory=list)  # tokens emitted per target forward
    budgets: list[int] = field(default_factory=list)  # DDTree budget verified at each step
    draft_s: float = 0.0  # eager only: graph steps are one replay with no phase boundaries
    verify_s: float = 0.0
    host_s: float = 0.0  # CPU time between steps, waits excluded (graph mode)
    steps: int = 0

    @property
    def tau(self) -> float:
        """Tokens per target forward (accepted drafts + the bonus), prefill excluded."""
        return sum(self.accepted_per_step) / len(self.accepted_per_step) if self.accepted_per_step else 1.0


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated, without the stop token
    text: str = ""  # decoded token_ids, special tokens left out, cut before a stop string
    finish_reason: str | None = None  # "stop" | "length"
    stats: SpecStats = field(default_factory=SpecStats)


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
    tables: TreeTables = field(default_factory=TreeTables)  # tree-builder constants, as long as the graphs

    def models(self, target: Callable | None = None) -> StepModels:
        kv, dc = self.cache.kv_LRTC, self.dcache
        return StepModels(target or self.model, self.drafter, kv, dc, self.absorb, self.static, self.tables)


@dataclass
class BatchState:
    """The rows of one batch. The device tensors are the graphs' static buffers in graph mode, so the
    host writes admitted and retired rows straight into what the next replay reads."""

    spec: SpecConfig
    lens: torch.Tensor  # [cap] committed length per row
    bonus: torch.Tensor  # [cap] next root token
    alive: torch.Tensor  # [cap] bool
    shared: torch.Generator  # draws of sampled rows without a seed of their own
    noise: torch.Tensor | None  # [cap, nodes, V] Exp(1) draws (sampled rows), allocated when first needed
    nodes: int  # verify tokens a step may write past a row's length
    graph: GraphStepper | None = None
    policy: BudgetPolicy | None = None
    outs: list[RequestOutput | None] = field(init=False)  # per slot, sized by __post_init__
    params: list[SamplingParams | None] = field(init=False)
    stops: list[frozenset[int]] = field(init=False)
    gens: list[torch.Generator | None] = field(init=False)
    live: list[int] = field(default_factory=list)
    timer: PhaseTimer | None = None
    rs: RowSampling | None = None  # eager: rebuilt when rows come or go

    def __post_init__(self) -> None:
        cap = self.capacity
        self.outs, self.params, self.gens = [None] * cap, [None] * cap, [None] * cap
        self.stops = [frozenset()] * cap

    @property
    def capacity(self) -> int:
        return self.lens.shape[0]

    def free_slots(self) -> list[int]:
        return [b for b in range(self.capacity) if self.outs[b] is None]

    @property
    def greedy(self) -> bool:
        return all(self.params[b].temperature == 0 for b in self.live)


class Decoder:
    """Admits, steps and retires the rows of `BatchState`s on the injected models and caches."""

    def __init__(self, ctx: DecodeContext):
        self.ctx = ctx
        self.runners: dict[tuple, StepGraphs] = {}
        self.policies: dict[tuple, BudgetPolicy] = {}
        self.measured: dict[tuple, bool] = {}
        self.states: dict[SpecConfig, dict] = {}  # graph static states, shared by a method's runners

    # -- a batch ----------------------------------------------------------------------------------
    def open(self, spec: SpecConfig, capacity: int, kinds: tuple[bool, ...] = (True, False)) -> BatchState:
        """An empty batch of `capacity` rows (graphs: the smallest bucket that holds them), with its graphs
        captured (`kinds`: greedy True / sampled False) and the adaptive budget's costs measured, before
        any prefill: both run on the caches as scratch."""
        ctx, dev = self.ctx, self.ctx.device
        nodes = verify_nodes(spec, ctx.drafter.cfg.block_size if ctx.drafter is not None else 1)
        graph, buckets, cap = None, None, capacity
        if ctx.graphs:
            fit = pick_bucket(ctx.buckets_for(spec), capacity, nodes)
            cap = fit.batch
            # adaptive: one bucket per candidate budget, sharing the batch's static state
            buckets = [Bucket(cap, c + 1) for c in spec.candidates] if spec.auto else [fit]
        policy = self._policy(spec, cap) if spec.auto else None  # before capture: the graphs read it
        if ctx.graphs:
            runners = {g: self._runner(spec, g) for g in kinds}
            for r in runners.values():
                r.capture(buckets, progress=ctx.progress)
            graph = GraphStepper(runners, buckets)
            nodes = graph.nodes
        if policy is not None and spec.costs is None and not self.measured.get((spec, cap)):
            policy.set_costs(0.0, *self._measure_costs(spec, graph, buckets, cap))
            policy.reset()  # the timing steps ran on scratch data: forget what they taught
            self.measured[(spec, cap)] = True
        if graph is not None:
            st = graph.state
            st.reset()
            lens, bonus, alive, noise = st.start, st.bonus, st.alive, st.noise
        else:
            z = torch.zeros(cap, dtype=torch.long, device=dev)
            lens, bonus, alive, noise = z, z.clone(), torch.zeros(cap, dtype=torch.bool, device=dev), None
        seed = _shared_seed(dev) if ctx.tp_size > 1 else int(torch.randint(0, 2**62, ()))
        timer = PhaseTimer(dev) if spec.method != "ar" and graph is None else None
        shared = torch.Generator(device=dev).manual_seed(seed)
        return BatchState(spec, lens, bonus, alive, shared, noise, nodes, graph, policy, timer=timer)

    def admit(self, state: BatchState, prompts: list[list[int]], params: list[SamplingParams]) -> list[int]:
        """Put prompts into free slots, prefill them together and emit their first token; returns the
        slots (the caller checked there are enough)."""
        ctx = self.ctx
        slots = state.free_slots()[: len(prompts)]
        for b, p, sp in zip(slots, prompts, params):
            state.outs[b], state.params[b] = RequestOutput(prompt_token_ids=p), sp
            state.stops[b] = frozenset(
                sp.stop_token_ids if sp.stop_token_ids is not None else ctx.tokenizer.stop_ids
            )
            state.gens[b] = (
                None if sp.seed is None else torch.Generator(device=ctx.device).manual_seed(sp.seed)
            )
            if state.graph is not None:  # the per-row sampling the captured step reads
                st = state.graph.state
                st.temperature[b], st.top_p[b], st.top_k[b] = float(sp.temperature), float(sp.top_p), sp.top_k
        state.rs = None
        go = [(b, p) for b, p, sp in zip(slots, prompts, params) if sp.max_tokens > 0]
        for b, sp in zip(slots, params):
            if sp.max_tokens == 0:
                self._finish(state, b, "length")
        if not go:
            return slots
        rows = torch.tensor([b for b, _ in go], device=ctx.device)
        state.live += [b for b, _ in go]
        rs = self._sampling(state, [b for b, _ in go])
        h, lens = self._prefill([p for _, p in go], rows, state.spec.method != "ar")
        state.lens[rows], state.bonus[rows], state.alive[rows] = (
            lens,
            ctx.models().next_token(h, rs.rows(rows)),
            True,
        )
        self._emit(state, [b for b, _ in go], {b: [t] for (b, _), t in zip(go, state.bonus[rows].tolist())})
        return slots

    def release(self, state: BatchState, slot: int) -> RequestOutput | None:
        """Free a slot (a finished row, or a cancelled request: its row stops at the next step)."""
        out = state.outs[slot]
        if slot in state.live:
            state.live.remove(slot)
        state.alive[slot] = False
        state.outs[slot] = state.params[slot] = state.gens[slot] = None
        state.rs = None
        return out

    def step(self, state: BatchState) -> list[int]:
        """Advance every live row by one step; returns the rows that stepped (their outputs grew)."""
        ctx, was = self.ctx, list(state.live)
        room = state.spec.method == "ar" or self._room(state, state.nodes)
        rs = self._sampling(state, was, nodes=1 if not room else None)
        if state.graph is not None and room:
            new, counts, budget = state.graph(state.greedy)
        elif room and state.spec.method != "ar":
            r = speculative_step(
                ctx.models(),
                torch.arange(state.capacity, device=ctx.device),
                state.lens,
                state.bonus,
                state.alive,
                state.spec,
                rs,
                state.timer,
                policy=state.policy,
            )
            counts = r.n_emitted.tolist()  # the step's one host read, with the tokens
            new, budget = [e[:n] for e, n in zip(r.emitted.tolist(), counts)], r.budget
            state.lens.add_(r.n_emitted), state.bonus.copy_(r.bonus)
        else:  # AR, or no room for another verify tree: this step decodes one token like AR
            rows = torch.arange(state.capacity, device=ctx.device)
            h, _ = ctx.model(
                state.bonus[:, None],
                AttnBatch.causal(state.lens, 1, rows, static=ctx.static),
                ctx.cache.kv_LRTC,
                absorb=ctx.absorb,
            )
            state.bonus.copy_(ctx.models().next_token(h[:, 0], rs))
            state.lens.add_(state.alive.long())  # finished rows stay frozen, rewriting only their own slot
            counts, budget = [1] * state.capacity, None
            new = [[t] for t in state.bonus.tolist()]
        for b in was:
            st = state.outs[b].stats
            st.accepted_per_step.append(counts[b])
            st.steps += 1
            if budget is not None:
                st.budgets.append(budget)
        self._emit(state, was, {b: new[b] for b in was})
        return was

    def run(
        self, prompts: list[list[int]], sp: SamplingParams, spec: SpecConfig
    ) -> Iterator[list[RequestOutput]]:
        """One fixed batch from prefill to the end, yielding the outputs after every step."""
        state = self.open(spec, len(prompts), kinds=(sp.temperature == 0,))
        self.admit(state, prompts, [sp] * len(prompts))
        outs = state.outs[: len(prompts)]
        yield outs
        while state.live:
            self.step(state)
            yield outs

    # -- pieces -----------------------------------------------------------------------------------
    def _prefill(self, prompts, rows, aux: bool):
        ctx, dev = self.ctx, self.ctx.device
        B, T = len(prompts), max(map(len, prompts))
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        aux_layers = ctx.drafter.cfg.target_layer_ids if aux else ()
        with nvtx_range("prefill"):
            batch = AttnBatch.causal(torch.zeros(B, dtype=torch.long, device=dev), T, rows)
            h, feats = ctx.model(
                ids.to(dev), batch, ctx.cache.kv_LRTC, aux_layers=aux_layers, absorb=ctx.absorb
            )
            if aux_layers:
                pos = torch.arange(T, device=dev).expand(B, T)
                ctx.drafter.append_context(
                    ctx.dcache.k, ctx.dcache.v, feats, pos, rows, valid_BC=pos < lens[:, None]
                )
        return h[torch.arange(B, device=dev), lens - 1], lens

    def _sampling(self, state: BatchState, rows: list[int], nodes: int | None = None) -> RowSampling:
        """The batch's per-row sampling, with fresh noise for `rows` when any live row samples."""
        ctx = self.ctx
        sampled = [b for b in rows if state.params[b].temperature > 0]
        if state.graph is not None:
            rs = state.graph.state.sampling(state.greedy)
        else:
            if state.rs is None:
                state.rs = RowSampling.of(state.params, ctx.device)
            rs = state.rs
            if sampled and state.noise is None:
                V = ctx.model.cfg.vocab_size
                state.noise = torch.empty(state.capacity, state.nodes, V, device=ctx.device)
            rs.noise = state.noise if not rs.greedy else None
        if sampled:
            n = nodes or state.nodes
            for b in sampled:
                state.noise[b, :n].exponential_(1.0, generator=state.gens[b] or state.shared)
        return rs

    def _emit(self, state: BatchState, rows: list[int], new: dict[int, list[int]]) -> None:
        """Append each row's new tokens, stopping at a stop id / string, max_tokens or the context."""
        for b in rows:
            o, sp = state.outs[b], state.params[b]
            for t in new[b]:
                if t in state.stops[b]:
                    self._finish(state, b, "stop")
                    break
                o.token_ids.append(t)
                if sp.stop and self._cut_at_stop_string(o, sp.stop):
                    self._finish(state, b, "stop")
                    break
                if (
                    len(o.token_ids) >= sp.max_tokens
                    or len(o.prompt_token_ids) + len(o.token_ids) >= self.ctx.max_model_len
                ):
                    self._finish(state, b, "length")
                    break

    def _finish(self, state: BatchState, b: int, reason: str) -> None:
        o = state.outs[b]
        o.finish_reason = reason
        if state.graph is not None:
            o.stats.host_s = state.graph.host_s
        elif state.timer is not None:  # batch-wide phase totals so far (one sync, at the end of a row)
            o.stats.draft_s, o.stats.verify_s = state.timer.total("draft"), state.timer.total("verify")
        if not o.text:
            o.text = self.ctx.tokenizer.decode(o.token_ids, skip_special=True)
        if b in state.live:
            state.live.remove(b)
            state.alive[b] = False

    def _cut_at_stop_string(self, o: RequestOutput, stop: tuple[str, ...]) -> bool:
        text = self.ctx.tokenizer.decode(o.token_ids, skip_special=True)
        hits = [text.find(s) for s in stop if s in text]
        if not hits:
            return False
        o.text = text[: min(hits)]
        return True

    def _room(self, state: BatchState, nodes: int) -> bool:
        """Whether every live row still has cache room for a speculative step of `nodes` tokens."""
        ctx = self.ctx
        room = ctx.max_model_len - nodes
        if ctx.dcache is not None:
            room = min(room, ctx.dcache.k.shape[2] - ctx.drafter.cfg.block_size)
        return (
            max(
                (len(o.prompt_token_ids) + len(o.token_ids) for o in map(state.outs.__getitem__, state.live)),
                default=0,
            )
            <= room
        )

    # -- graphs and the adaptive budget -----------------------------------------------------------
    def _runner(self, spec: SpecConfig, greedy: bool) -> StepGraphs:
        key = (spec, greedy)
        if key not in self.runners:
            ctx = self.ctx
            width = ctx.drafter.cfg.block_size if spec.method != "ar" else 1
            step = graph_step(
                ctx.models(ctx.target), spec, greedy, lambda batch: self.policies.get((spec, batch))
            )
            self.runners[key] = StepGraphs(
                step,
                width,
                ctx.device,
                states=self.states.setdefault(spec, {}),
                vocab=0 if greedy else ctx.model.cfg.vocab_size,
            )
        return self.runners[key]

    def _policy(self, spec: SpecConfig, batch: int) -> BudgetPolicy:
        """The budget policy of one (spec, batch size): costs from the SpecConfig, else equal placeholders
        that `open` replaces by measurement (graph replays or eager steps) before the first prefill."""
        key = (spec, batch)
        if key not in self.policies:
            costs = spec.costs or (0.0, *([1.0] * len(spec.candidates)))
            g = self.ctx.graphs  # graphs: compiled policy, and the choice applies to the next step
            self.policies[key] = BudgetPolicy.create(
                spec.candidates,
                costs[0],
                costs[1:],
                self.ctx.device,
                per_token=spec.cost_per_token,
                rows=batch,
                compiled=g,
                lagged=g,
            )
        return self.policies[key]

    def _measure_costs(self, spec, graph: GraphStepper | None, buckets, batch: int):
        """Per candidate: seconds per whole step at context 0 and per context token (budget.fit_costs)."""
        ctx = self.ctx
        ats = timing_contexts(ctx.max_model_len, spec.candidates[-1], ctx.drafter.cfg.block_size)
        if graph is not None:
            t = [[graph.time_candidate(b, at) for b in buckets] for at in ats]
        else:
            t = [[time_step(ctx.models(), spec.fixed(c), batch, at) for c in spec.candidates] for at in ats]
        t = torch.tensor(t, device=ctx.device)
        if ctx.tp_size > 1:  # every rank must pick the same budget: agree on the slowest timings
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return fit_costs(t, ats)


def _shared_seed(dev: torch.device) -> int:
    """A fresh seed chosen on rank 0 and broadcast, so every TP rank samples the same tokens."""
    import torch.distributed as dist

    t = (
        torch.randint(0, 2**62, (1,), device=dev)
        if dist.get_rank() == 0
        else torch.zeros(1, dtype=torch.long, device=dev)
    )
    dist.broadcast(t, src=0)
    return int(t)
