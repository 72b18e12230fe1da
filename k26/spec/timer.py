"""Phase times of eager speculative steps (draft, tree, verify, accept) without a sync per step, with NVTX
ranges around each phase."""

from __future__ import annotations

import time

import torch

from ..profiling import nvtx_range


class PhaseTimer:
    """Phase times without a sync per step: wall clock on CPU; on GPU CUDA events, each phase's pairs
    folded into its total once more than `HELD` wait (all but the newest: eager steps read their tokens
    back every step, so the older pairs are long complete), so a long generation holds a bounded number."""

    HELD = 32

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = {}  # seconds folded so far, per phase
        self.pending: dict[str, list] = {}  # CUDA: (start, end) event pairs not folded yet, per phase

    def __call__(self, name: str):
        return _Span(self, name)

    def add(self, name: str, span) -> None:
        """One span of `name`: seconds (CPU) or a (start, end) pair of recorded CUDA events."""
        if not self.cuda:
            self.totals[name] = self.totals.get(name, 0.0) + span
            return
        pending = self.pending.setdefault(name, [])
        pending.append(span)
        if len(pending) > self.HELD:
            self._fold(name, len(pending) - 1)

    def _fold(self, name: str, n: int) -> None:
        pending = self.pending[name]
        done, self.pending[name] = pending[:n], pending[n:]
        for a, b in done:
            b.synchronize()
        self.totals[name] = self.totals.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in done) / 1e3

    def held(self) -> int:
        """Event pairs waiting to be folded (bounded by `HELD` per phase)."""
        return sum(map(len, self.pending.values()))

    def total(self, name: str) -> float:
        if name in self.pending:
            self._fold(name, len(self.pending[name]))
        return self.totals.get(name, 0.0)


class _Span:
    def __init__(self, timer: PhaseTimer, name: str):
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
            self.t.add(self.name, (self.a, b))
        else:
            self.t.add(self.name, time.perf_counter() - self.a)
        self.r.__exit__(*exc)
        return False


class null_span:
    """A span that times nothing (no timer given)."""

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
