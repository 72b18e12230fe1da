"""Decode steps as CUDA-graph replays: the captured body (AR or one speculative step over a bucket's static
state) and the host side of a step (replay, one small device-to-host copy, the adaptive bucket choice).

The body reads the batch from the static `StepState` and advances it in place (start += emitted, bonus =
next), so the host between replays only copies the emitted tokens back and, at step boundaries, writes
the rows it admits or retires (continuous batching) into the same buffers.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from ..sampling import MODES, RowSampling, StepLogprobs
from ..spec.budget import BudgetPolicy
from ..spec.step import SpecConfig, StepModels, Stepped, ar_step, reported_budgets, speculative_step
from .buckets import Bucket
from .runner import StepGraphs, StepState


def graph_step(
    m: StepModels, spec: SpecConfig, mode: str, policy_for: Callable[[int], BudgetPolicy | None]
) -> Callable[[StepState, Bucket], None]:
    """The body captured per bucket: one decode step of every row of the bucket's static state, with static
    shapes (whole cache rows, no host sync) so that warm-ups, capture and an eager call run the same code.
    `mode` (`sampling.MODES`) is fixed at capture: only the "filter" and "logprobs" bodies sort the
    vocabulary and read `state.penalties`; only a "logprobs" body writes `state.logprobs`."""
    m = dataclasses.replace(m, static=True)

    def step(state: StepState, bucket: Bucket) -> None:
        rs = RowSampling.in_mode(
            mode, state.temperature, state.top_p, state.top_k, state.noise, state.penalties
        )
        if spec.method == "ar":
            tok, lp = ar_step(m, state.rows, state.start, state.bonus, rs)
            state.emitted[:, 0].copy_(tok)
            state.n_emitted.copy_(state.alive.long())
        else:
            policy = policy_for(bucket.batch) if spec.auto else None
            step_spec = spec.fixed(bucket.nodes - 1) if spec.auto else spec
            r = speculative_step(
                m,
                state.rows,
                state.start,
                state.bonus,
                state.alive,
                step_spec,
                rs,
                nodes=bucket.nodes,
                policy=policy,
            )
            state.emitted.copy_(r.emitted)
            state.n_emitted.copy_(r.n_emitted)
            if r.choice is not None:
                state.choice.copy_(r.choice.view(1))
            tok, lp = r.bonus, r.logprobs
        if lp is not None:  # the "logprobs" mode's body: the emitted tokens' (as wide as `emitted`)
            state.logprobs.copy_(lp)
        state.start.add_(state.n_emitted)
        state.bonus.copy_(torch.where(state.alive, tok, state.bonus))

    return step


def serving_mode(mode: str, captured) -> str:
    """The cheapest captured sampling mode that serves rows needing `mode` (a mode serves those before it
    in `sampling.MODES`: the filtered sampler serves every row, the full-softmax race greedy ones too)."""
    for m in MODES[MODES.index(mode) :]:
        if m in captured:
            return m
    raise ValueError(f"no step graph serves sampling mode {mode!r} (captured: {sorted(captured)})")


class GraphStepper:
    """Host side of graph decoding for one batch: replays the current bucket of the graphs of the cheapest
    captured sampling mode that serves the live rows (every mode's graphs share the batch's static state),
    reads the step's tokens back, and follows the adaptive budget's choice to the next bucket (one step
    late: a graph cannot branch on its own draft)."""

    def __init__(self, runners: dict[str, StepGraphs], buckets: list[Bucket], budgets: list[int | None]):
        """`budgets`: what a step of each bucket reports as verified (spec.step.reported_budgets), not the
        bucket's width (a DFlash chain, a fixed budget padded up to a user bucket)."""
        self.runners, self.buckets = runners, buckets
        self.budget_of = dict(zip(buckets, budgets, strict=True))
        self.bucket = buckets[-1]  # adaptive: start with the largest, then follow each step's choice
        self.state = next(iter(runners.values())).states[self.bucket]
        self.host_em = torch.empty_like(self.state.emitted, device="cpu").pin_memory()
        self.host_n = torch.empty_like(self.state.n_emitted, device="cpu").pin_memory()
        self.host_c = torch.empty_like(self.state.choice, device="cpu").pin_memory()
        self.host_lp: StepLogprobs | None = None  # pinned copies of the "logprobs" mode's results
        self.done = torch.cuda.Event()
        self.host_s = 0.0  # CPU time of the steps, waits excluded

    @property
    def nodes(self) -> int:
        """Verify tokens a step may write past a row's length (the padded buckets write this far)."""
        return max(b.nodes for b in self.buckets)

    def __call__(self, mode: str) -> Stepped:
        """One replay for rows sampled in `mode`: the emitted tokens per row, their counts, the budget
        verified (or None) and, in the "logprobs" mode, their logprobs."""
        st, bucket, serving = self.state, self.bucket, serving_mode(mode, self.runners)
        t0 = time.perf_counter()
        self.runners[serving].replay(bucket)
        self.host_em.copy_(st.emitted, non_blocking=True)  # the step's one small device-to-host copy
        self.host_n.copy_(st.n_emitted, non_blocking=True)
        self.host_c.copy_(st.choice, non_blocking=True)
        lp = None
        if serving == "logprobs":
            if self.host_lp is None:
                self.host_lp = st.logprobs.pinned_like()
            self.host_lp.copy_(st.logprobs, non_blocking=True)
            lp = self.host_lp
        self.done.record()
        t1 = time.perf_counter()
        self.done.synchronize()
        t2 = time.perf_counter()
        counts, emitted = self.host_n.tolist(), self.host_em.tolist()
        if len(self.buckets) > 1:
            self.bucket = self.buckets[int(self.host_c[0])]
        self.host_s += (t1 - t0) + (time.perf_counter() - t2)
        return Stepped(
            [e[:n] for e, n in zip(emitted, counts)],
            counts,
            self.budget_of[bucket],
            lp,
        )

    def time_buckets(self, at: int, rounds: int = 7) -> list[float]:
        """Seconds per step of each bucket (one per candidate budget) at context `at`, on scratch caches
        (before any prefill): the median of `rounds` single replays, each launched and waited for alone as
        the decode loop does (it reads every step's tokens back). Replays timed back to back overlapped
        each launch with the previous replay and measured the buckets out of order (tiny pair, H200, 4K
        rows: 15 cheaper than 3 and 7, 31 dearer than 15 by 0.15 ms where the decode loop saw 0.11), so the
        rule kept budget 15 at 0.95 of budget 31's tokens/s; timed this way, 0.98 (2026-12-01 results,
        bench_budget-h200-session6). The buckets take turns within each round, so clock drift reaches all
        of them alike."""
        graph = next(iter(self.runners.values()))
        times: list[list[float]] = [[] for _ in self.buckets]
        for r in range(rounds + 1):  # round 0 warms each bucket up (and the clocks)
            for i, bucket in enumerate(self.buckets):
                state = graph.states[bucket]
                state.start.fill_(at), state.alive.fill_(True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay(bucket)
                torch.cuda.synchronize()
                if r:
                    times[i].append(time.perf_counter() - t0)
        for bucket in self.buckets:
            graph.states[bucket].reset()
        return [statistics.median(t) for t in times]


class DecodeGraphs:
    """A decoder's step graphs: per (SpecConfig, sampling mode) one `StepGraphs`, a method's graphs of every
    mode sharing its static states; made on first use and kept as long as the decoder (its caches and
    budget policies are what the graphs read)."""

    def __init__(
        self,
        models: Callable[[], StepModels],
        device: torch.device,
        block: int,
        vocab: int,
        policy_for: Callable[[SpecConfig, int], BudgetPolicy | None],
    ):
        self.models, self.device, self.block, self.vocab = models, device, block, vocab
        self.policy_for = policy_for  # looked up when a bucket is captured: the policy exists by then
        self.runners: dict[tuple, StepGraphs] = {}
        self.states: dict[SpecConfig, dict] = {}  # graph static states, shared by a method's runners

    def runner(self, spec: SpecConfig, mode: str) -> StepGraphs:
        key = (spec, mode)
        if key not in self.runners:
            width = self.block if spec.method != "ar" else 1
            step = graph_step(self.models(), spec, mode, lambda batch: self.policy_for(spec, batch))
            self.runners[key] = StepGraphs(
                step,
                width,
                self.device,
                states=self.states.setdefault(spec, {}),
                vocab=0 if mode == "greedy" else self.vocab,
                logprobs=mode == "logprobs",
                penalties=mode in ("filter", "logprobs"),
            )
        return self.runners[key]

    def stepper(
        self, spec: SpecConfig, fit: Bucket, kinds: tuple[str, ...], progress: bool = False
    ) -> GraphStepper:
        """The graphs of one batch captured (`kinds`: sampling modes) over the bucket `fit`, or for the
        adaptive budget one bucket per candidate budget, sharing the batch's static state."""
        buckets = [Bucket(fit.batch, c + 1) for c in spec.candidates] if spec.auto else [fit]
        runners = {g: self.runner(spec, g) for g in kinds}
        for r in runners.values():
            r.capture(buckets, progress=progress)
        return GraphStepper(runners, buckets, reported_budgets(spec))
