"""Own CUDA-graph capture per bucket (nano-vllm style): static state in, static results out, the whole
step — for speculative methods draft, tree, verify, accept, commit, context update — in one replay.

Rules followed (gpu-targets.md §6): everything compiled and built before capture, two warm-ups on a
side stream, largest bucket first into one shared memory pool, no host sync inside the step, every
per-step input lives in a static buffer that the step itself advances (start += emitted, bonus = next).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..penalties import Penalties
from ..profiling import nvtx_range
from ..sampling import StepLogprobs
from ..startup import CaptureRecord, phase_bar
from .buckets import Bucket


@dataclass
class StepState:
    """Static buffers of one bucket; the captured step reads and advances them in place."""

    rows: torch.Tensor  # [Bb] cache row per sequence (dummy rows: spare cache rows)
    start: torch.Tensor  # [Bb] committed length
    bonus: torch.Tensor  # [Bb] next root token
    alive: torch.Tensor  # [Bb] bool
    emitted: torch.Tensor  # [Bb, J] tokens emitted by the last step, -1 after
    n_emitted: torch.Tensor  # [Bb]
    choice: torch.Tensor  # [1] adaptive budget: the candidate the last step's tree favours
    temperature: torch.Tensor  # [Bb] float32 per-row sampling (continuous batching mixes requests)
    top_p: torch.Tensor  # [Bb] float32
    top_k: torch.Tensor  # [Bb] int64
    noise: torch.Tensor | None = None  # [Bb, nodes of the largest bucket, V] Exp(1) draws (sampled graphs)
    logprobs: StepLogprobs | None = None  # [Bb, J] the emitted tokens' ("logprobs" graphs)
    penalties: Penalties | None = None  # the rows' penalties and biases ("filter" / "logprobs" graphs)
    row_of: list[int] | None = None  # `rows` as the host last wrote it (None: unknown, after a reset)

    @classmethod
    def allocate(cls, bucket: Bucket, width: int, device) -> StepState:
        z = torch.zeros(bucket.batch, dtype=torch.long, device=device)
        f = torch.zeros(bucket.batch, dtype=torch.float32, device=device)
        return cls(
            torch.arange(bucket.batch, device=device),
            z.clone(),
            z.clone(),
            torch.zeros(bucket.batch, dtype=torch.bool, device=device),
            torch.full((bucket.batch, width), -1, dtype=torch.long, device=device),
            z.clone(),
            torch.zeros(1, dtype=torch.long, device=device),
            f.clone(),
            f + 1,
            z.clone(),
        )

    def reset(self) -> None:
        (
            self.rows.copy_(torch.arange(self.rows.shape[0])),
            self.start.zero_(),
            self.bonus.zero_(),
            self.alive.zero_(),
            self.emitted.fill_(-1),
            self.n_emitted.zero_(),
        )
        self.choice.zero_()
        self.row_of = None


class StepGraphs:
    """Captures `step(state)` once per bucket and replays it. Buckets of one batch size share their
    static state, so consecutive steps may replay different buckets (adaptive budgets)."""

    def __init__(
        self,
        step: Callable[[StepState, Bucket], None],
        width: int,
        device: torch.device,
        states: dict[Bucket, StepState] | None = None,
        vocab: int = 0,
        logprobs: bool = False,
        penalties: bool = False,
    ):
        self.step, self.width, self.device = step, width, device
        # shared with the other runners of the same method (each sampling mode's graphs of one batch state),
        # so a batch can switch between them from one step to the next
        self.states: dict[Bucket, StepState] = {} if states is None else states
        self.vocab = vocab  # > 0: the step samples, and reads noise [Bb, nodes, vocab]
        self.logprobs = logprobs  # the step writes the emitted tokens' logprobs (state.logprobs)
        self.penalties = penalties  # the step reads the rows' penalties (state.penalties; host-written)
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.report: list[CaptureRecord] = []  # per bucket: capture seconds (warm-ups included), pool bytes
        self.pool = None

    def capture(self, buckets: list[Bucket], progress: bool = True) -> None:
        """Capture the buckets not captured yet, largest first; one progress line (buckets, ETA) on a
        terminal when `progress`."""
        todo = sorted(set(buckets) - set(self.graphs), reverse=True)  # largest first: smaller reuse its pool
        if not todo:
            return
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with phase_bar("capture", len(todo), "graph", progress) as bar:
            for bucket in todo:
                self._capture_one(bucket)
                bar.update()

    def _capture_one(self, bucket: Bucket) -> None:
        with nvtx_range(f"capture b{bucket.batch} n{bucket.nodes}"):
            state = next((st for b, st in self.states.items() if b.batch == bucket.batch), None)
            state = state or StepState.allocate(bucket, self.width, self.device)
            if self.vocab and state.noise is None:  # largest bucket first: this is the batch's widest
                state.noise = torch.ones(bucket.batch, bucket.nodes, self.vocab, device=self.device)
            if self.logprobs and state.logprobs is None:
                state.logprobs = StepLogprobs.empty(bucket.batch, self.width, self.vocab, self.device)
            if self.penalties and state.penalties is None:
                state.penalties = Penalties.allocate(bucket.batch, self.vocab, self.device)
            # reserved bytes with the allocator's free cache dropped before and after: what the graph pool
            # keeps (a load's freed temporaries, e.g. the int4 layout before the repack, would otherwise
            # leave this bucket with a negative figure when warm-up frees them)
            t0, m0 = time.perf_counter(), _reserved(self.device)
            try:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # compile, autotune, load kernels, allocate: never during capture
                        self.step(state, bucket)
                        state.reset()
                torch.cuda.current_stream(self.device).wait_stream(side)
                _barrier()  # every TP rank captures the same collectives in the same order
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self.step(state, bucket)
                torch.cuda.synchronize(self.device)
                _barrier()
            except Exception as e:
                raise CaptureError(
                    f"CUDA graph capture of bucket (batch {bucket.batch}, nodes {bucket.nodes}) "
                    f"failed: {e}. "
                    "Reduce max_batch, the DDTree budget or max_model_len, or pass graphs=False"
                ) from e
            state.reset()
            self.states[bucket], self.graphs[bucket] = state, g
            self.report.append(CaptureRecord(bucket, time.perf_counter() - t0, _reserved(self.device) - m0))

    def replay(self, bucket: Bucket) -> StepState:
        with nvtx_range("replay"):
            self.graphs[bucket].replay()
        return self.states[bucket]


class CaptureError(RuntimeError):
    """A bucket's graph could not be captured (out of GPU memory for a large budget or batch, mostly): what
    the user can change is in the message, so the CLI prints it in one line, not a traceback."""


def _reserved(device: torch.device) -> int:
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
