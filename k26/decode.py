"""Decode loops over one batch of prompts: autoregressive, DFlash and DDTree, eager or one CUDA-graph
replay per step. Each loop is a generator that yields after every step, so `generate` drains it and
`stream` forwards the increments.

Graph mode: per (method, budget, sampling) a `StepGraphs` captures the whole step per bucket before
the batch's prefill (the caches are scratch then); the host loop is replay, one small copy of the
emitted tokens back, bookkeeping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from .graphs import Bucket, StepGraphs, StepState, pick_bucket
from .model import AttnBatch
from .ops.reference import static_shapes
from .profiling import nvtx_range
from .sampling import SamplingParams, sample
from .spec.budget import BudgetPolicy
from .spec.step import SpecConfig, speculative_step, verify_nodes


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


class Decoder:
    """Runs batches on an `LLM`'s model, drafter and caches."""

    def __init__(self, llm):
        self.llm = llm
        self.runners: dict[tuple, StepGraphs] = {}
        self.policies: dict[tuple, BudgetPolicy] = {}
        self.measured: dict[tuple, bool] = {}
        self.target = llm.model_fwd  # compiled or plain

    # -- shared pieces ---------------------------------------------------------------------------
    def _prefill(self, prompts, rows, aux_layers):
        llm, dev = self.llm, self.llm.device
        B, T = len(prompts), max(map(len, prompts))
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        with nvtx_range("prefill"):
            batch = AttnBatch.causal(torch.zeros(B, dtype=torch.long, device=dev), T, rows)
            h, aux = llm.model(ids.to(dev), batch, llm.cache.kv_LRTC, aux_layers=aux_layers, absorb=llm.absorb)
            if aux_layers:
                pos = torch.arange(T, device=dev).expand(B, T)
                llm.drafter.append_context(llm.dcache.k, llm.dcache.v, aux, pos, rows, valid_BC=pos < lens[:, None])
        return h[torch.arange(B, device=dev), lens - 1], lens

    def _next(self, h, sp: SamplingParams, gen):
        """Next token from final hidden states: the shards' argmax merged when greedy, else a sample."""
        head = self.llm.model.lm_head
        return head.argmax(h) if sp.temperature == 0 else sample(self.llm.model.logits(h), sp, gen)

    def _emit(self, outs, live: list[int], new: list[list[int]], stops: set[int], sp: SamplingParams) -> None:
        """Append each live sequence's new tokens, stopping at a stop id / string, max_tokens or the context."""
        for b in list(live):
            o = outs[b]
            for t in new[b]:
                if t in stops:
                    o.finish_reason = "stop"
                    break
                o.token_ids.append(t)
                if sp.stop and self._cut_at_stop_string(o, sp.stop):
                    break
                if len(o.token_ids) >= sp.max_tokens or len(o.prompt_token_ids) + len(o.token_ids) >= self.llm.max_model_len:
                    o.finish_reason = "length"
                    break
            if o.finish_reason:
                live.remove(b)

    def _cut_at_stop_string(self, o: RequestOutput, stop: tuple[str, ...]) -> bool:
        text = self.llm.tokenizer.decode(o.token_ids, skip_special=True)
        hits = [text.find(s) for s in stop if s in text]
        if not hits:
            return False
        o.text, o.finish_reason = text[: min(hits)], "stop"
        return True

    def _room(self, outs, live, nodes: int) -> bool:
        """Whether every live sequence still has cache room for a speculative step of `nodes` tokens."""
        llm = self.llm
        room = llm.max_model_len - nodes
        if llm.dcache is not None:
            room = min(room, llm.dcache.k.shape[2] - llm.drafter.cfg.block_size)
        return max(len(outs[b].prompt_token_ids) + len(outs[b].token_ids) for b in live) <= room

    # -- entry -----------------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], sp: SamplingParams, spec: SpecConfig) -> Iterator[list[RequestOutput]]:
        llm = self.llm
        outs = [RequestOutput(prompt_token_ids=p) for p in prompts]
        if sp.max_tokens == 0:
            for o in outs:
                o.finish_reason = "length"
            yield outs
            return
        block = llm.drafter.cfg.block_size if llm.drafter is not None else 1
        nodes = verify_nodes(spec, block)
        graph, policy, buckets = None, None, None
        batch = len(prompts)
        if llm.graphs:
            graph = self._runner(spec, sp)
            fit = pick_bucket(llm.buckets_for(spec), len(prompts), nodes)
            batch = fit.batch
            # adaptive: one bucket per candidate budget, sharing the batch's static state
            buckets = [Bucket(batch, c + 1) for c in spec.candidates] if spec.auto else [fit]
        if spec.auto:  # exists before capture: the graphs read its device tensors
            policy = self._policy(spec, batch)
        if graph is not None:
            graph.capture(buckets, progress=llm.progress)
        if policy is not None and spec.costs is None and not self.measured.get((spec, batch)):
            policy.set_costs(0.0, *self._measure_costs(spec, sp, graph, buckets, batch))
            policy.reset()  # the timing steps ran on scratch data: forget what they taught
            self.measured[(spec, batch)] = True
        stops = set(sp.stop_token_ids if sp.stop_token_ids is not None else llm.tokenizer.stop_ids)
        if llm.tp_size > 1 and sp.seed is None and sp.temperature > 0:
            sp = replace(sp, seed=_shared_seed(dev=llm.device))  # every rank must draw the same samples
        gen = None
        if sp.seed is not None:
            if graph is not None:  # graphs draw from the device's default generator
                torch.cuda.manual_seed(sp.seed)
            else:
                gen = torch.Generator(device=llm.device).manual_seed(sp.seed)
        B, dev = len(prompts), llm.device
        rows = torch.arange(B, device=dev)
        aux_layers = llm.drafter.cfg.target_layer_ids if spec.method != "ar" else ()
        h, lens = self._prefill(prompts, rows, aux_layers)
        bonus = self._next(h, sp, gen)
        live = list(range(B))
        self._emit(outs, live, [[t] for t in bonus.tolist()], stops, sp)
        yield outs
        if graph is not None:
            nodes = max(b.nodes for b in buckets)  # padded buckets write this far
            lens, bonus = yield from self._graph_loop(graph, buckets, outs, live, lens, bonus, stops, sp, nodes)
            spec = SpecConfig("ar")  # out of room for another graph step: plain decoding to the end
        yield from self._eager_loop(outs, live, rows, lens, bonus, stops, sp, spec, gen, nodes, policy)
        for o in outs:
            if not o.text:
                o.text = llm.tokenizer.decode(o.token_ids, skip_special=True)

    # -- eager -----------------------------------------------------------------------------------
    def _eager_loop(self, outs, live, rows, lens, bonus, stops, sp, spec, gen, nodes, policy=None):
        llm, B, dev = self.llm, len(outs), self.llm.device
        timer = _Timer(dev) if spec.method != "ar" else None
        while live:
            alive = torch.zeros(B, dtype=torch.bool)
            alive[live] = True
            alive = alive.to(dev)
            if spec.method != "ar" and not self._room(outs, live, nodes):
                spec = SpecConfig("ar")  # no room for another verify tree: finish like plain decoding
            if spec.method != "ar":
                r = speculative_step(llm.model, llm.drafter, llm.cache.kv_LRTC, llm.dcache, rows, lens, bonus, alive,
                                     spec, sp, gen, llm.absorb, timer, policy=policy)
                emitted, counts = r.emitted.tolist(), r.n_emitted.tolist()  # the step's one host read
                for b in live:
                    outs[b].stats.accepted_per_step.append(counts[b])
                    if r.budget is not None:
                        outs[b].stats.budgets.append(r.budget)
                self._emit(outs, live, [e[: counts[b]] for b, e in enumerate(emitted)], stops, sp)
                lens, bonus = lens + r.n_emitted, r.bonus
            else:
                batch = AttnBatch.causal(lens, 1, rows)
                h, _ = llm.model(bonus[:, None], batch, llm.cache.kv_LRTC, absorb=llm.absorb)
                bonus = self._next(h[:, 0], sp, gen)
                lens = lens + alive.long()  # finished rows stay frozen and only rewrite their own last slot
                for b in live:
                    outs[b].stats.accepted_per_step.append(1)
                self._emit(outs, live, [[t] for t in bonus.tolist()], stops, sp)
            yield outs
        if timer is not None:
            for o in outs:
                o.stats.draft_s, o.stats.verify_s = timer.total("draft"), timer.total("verify")

    # -- graphs ----------------------------------------------------------------------------------
    def _runner(self, spec: SpecConfig, sp: SamplingParams) -> StepGraphs:
        key = (spec, sp.temperature, sp.top_p, sp.top_k)
        if key not in self.runners:
            llm = self.llm
            width = llm.drafter.cfg.block_size if spec.method != "ar" else 1

            def step(state: StepState, bucket: Bucket) -> None:
                with static_shapes():
                    if spec.method == "ar":
                        batch = AttnBatch.causal(state.start, 1, state.rows)
                        h, _ = self.target(state.bonus[:, None], batch, llm.cache.kv_LRTC, absorb=llm.absorb)
                        tok = self._next(h[:, 0], sp, None)
                        state.emitted[:, 0].copy_(tok)
                        state.n_emitted.copy_(state.alive.long())
                    else:
                        policy = self.policies.get((spec, bucket.batch)) if spec.auto else None
                        step_spec = spec.fixed(bucket.nodes - 1) if spec.auto else spec
                        r = speculative_step(self.target, llm.drafter, llm.cache.kv_LRTC, llm.dcache, state.rows,
                                             state.start, state.bonus, state.alive, step_spec, sp, None, llm.absorb,
                                             nodes=bucket.nodes, policy=policy)
                        state.emitted.copy_(r.emitted)
                        state.n_emitted.copy_(r.n_emitted)
                        if r.choice is not None:
                            state.choice.copy_(r.choice.view(1))
                        tok = r.bonus
                    state.start.add_(state.n_emitted)
                    state.bonus.copy_(torch.where(state.alive, tok, state.bonus))

            self.runners[key] = StepGraphs(step, width, llm.device)
        return self.runners[key]

    def _policy(self, spec: SpecConfig, batch: int) -> BudgetPolicy:
        """The budget policy of one (spec, batch size): costs from the SpecConfig, else equal placeholders
        that `run` replaces by measurement (graph replays or eager steps) before the batch's prefill."""
        key = (spec, batch)
        if key not in self.policies:
            costs = spec.costs or (0.0, *([1.0] * len(spec.candidates)))
            g = self.llm.graphs  # graphs: compiled policy, and the choice applies to the next step
            self.policies[key] = BudgetPolicy.create(spec.candidates, costs[0], costs[1:], self.llm.device,
                                                     per_token=spec.cost_per_token, rows=batch, compiled=g, lagged=g)
        return self.policies[key]

    def _measure_costs(self, spec, sp, graph, buckets, batch: int) -> tuple[list[float], list[float]]:
        """Per candidate: seconds per whole step at context 0 and per context token, from timings at a short
        and a long context (the line through them; flat when the cache is too short to tell them apart)."""
        llm = self.llm
        near = 16
        far = llm.max_model_len - spec.candidates[-1] - llm.drafter.cfg.block_size - 1
        ats = (near, far) if far - near >= 256 else (max(0, min(near, far)),)
        pairs = list(zip(buckets or [None] * len(spec.candidates), spec.candidates))
        t = torch.tensor([[self._measure(spec, sp, graph, b, c, batch, at) for b, c in pairs] for at in ats],
                         device=llm.device)
        if llm.tp_size > 1:  # every rank must pick the same budget: agree on the slowest timings
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        slope = ((t[-1] - t[0]) / (ats[-1] - ats[0])).clamp_min(0) if len(ats) > 1 else torch.zeros_like(t[0])
        return (t[0] - slope * ats[0]).clamp_min(1e-6).tolist(), slope.tolist()

    def _measure(self, spec, sp, graph, bucket, budget: int, batch: int, at: int) -> float:
        """Seconds per whole step at one candidate budget and context length (draft included: t_draft 0)."""
        llm = self.llm
        if graph is not None:
            state = graph.states[bucket]
            state.start.fill_(at), state.alive.fill_(True)
            graph.replay(bucket)
            best = float("inf")
            # best of three after a warm replay: one sample was too noisy to rank buckets 3 % apart, and the first
            # timings also ramp the clocks up
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(3):
                    state.start.fill_(at)
                    graph.replay(bucket)
                torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - t0) / 3)
            state.reset()
            return best
        dev = llm.device
        rows, start = torch.arange(batch, device=dev), torch.full((batch,), at, device=dev)
        bonus, alive = torch.zeros(batch, dtype=torch.long, device=dev), torch.ones(batch, dtype=torch.bool, device=dev)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            speculative_step(llm.model, llm.drafter, llm.cache.kv_LRTC, llm.dcache, rows, start, bonus, alive,
                             spec.fixed(budget), sp, None, llm.absorb)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    def _graph_loop(self, graph: StepGraphs, buckets, outs, live, lens, bonus, stops, sp, nodes):
        B = len(outs)
        bucket = buckets[-1]  # adaptive: start with the largest, then follow each step's choice
        state = graph.states[bucket]
        state.reset()
        state.start[:B] = lens
        state.bonus[:B] = bonus
        state.alive[:B] = torch.tensor([b in live for b in range(B)], device=state.alive.device)
        host_em = torch.empty_like(state.emitted, device="cpu").pin_memory()
        host_n = torch.empty_like(state.n_emitted, device="cpu").pin_memory()
        host_c = torch.empty_like(state.choice, device="cpu").pin_memory()
        done = torch.cuda.Event()
        host = 0.0
        while live:
            if not self._room(outs, live, nodes):
                break
            t0 = time.perf_counter()
            graph.replay(bucket)
            host_em.copy_(state.emitted, non_blocking=True)  # the step's one small device-to-host copy
            host_n.copy_(state.n_emitted, non_blocking=True)
            host_c.copy_(state.choice, non_blocking=True)
            done.record()
            t1 = time.perf_counter()
            done.synchronize()
            t2 = time.perf_counter()
            counts, emitted = host_n.tolist(), host_em.tolist()
            was = set(live)
            for b in live:
                outs[b].stats.accepted_per_step.append(counts[b])
                if bucket.nodes > 1:
                    outs[b].stats.budgets.append(bucket.nodes - 1)
            # adaptive budget: the next step replays the bucket this step's tree favoured (one step late:
            # a graph cannot branch on its own draft)
            bucket = buckets[int(host_c[0])] if len(buckets) > 1 else bucket
            self._emit(outs, live, [e[: counts[b]] for b, e in enumerate(emitted)], stops, sp)
            for b in was - set(live):
                state.alive[b] = False  # rare: a sequence finished
            host += (t1 - t0) + (time.perf_counter() - t2)
            for b in range(B):
                outs[b].stats.steps += b in was
                outs[b].stats.host_s = host
            yield outs
        return state.start[:B].clone(), state.bonus[:B].clone()


def _shared_seed(dev: torch.device) -> int:
    """A fresh seed chosen on rank 0 and broadcast, so every TP rank samples the same tokens."""
    import torch.distributed as dist

    t = torch.randint(0, 2**62, (1,), device=dev) if dist.get_rank() == 0 else torch.zeros(1, dtype=torch.long, device=dev)
    dist.broadcast(t, src=0)
    return int(t)


class _Timer:
    """Phase times without a sync per step: CUDA events on GPU (read at the end), wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}

    def __call__(self, name: str):
        return _Span(self, name)

    def total(self, name: str) -> float:
        spans = self.spans.get(name, [])
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1e3
        return sum(spans)


class _Span:
    def __init__(self, timer: _Timer, name: str):
        self.t, self.name = timer, name

    def __enter__(self):
        self.r = nvtx_range(self.name)
        self.r.__enter__()
        if self.t.cuda:
            self.a = torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.a = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.t.cuda:
            b = torch.cuda.Event(enable_timing=True)
            b.record()
            self.t.spans.setdefault(self.name, []).append((self.a, b))
        else:
            self.t.spans.setdefault(self.name, []).append(time.perf_counter() - self.a)
        self.r.__exit__(*exc)
        return False
