"""The server's counters, gauges and latency histograms, and their Prometheus text (`/metrics`). The
engine thread writes them, the HTTP thread reads them: plain ints and floats, no locks needed."""

from __future__ import annotations

import bisect
import collections
import time
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    """A Prometheus histogram: observations counted into fixed upper bounds (cumulative when written)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * (len(bounds) + 1), 0.0, 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1  # (le: a value on a bound counts in it)
        self.sum, self.count = self.sum + v, self.count + 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for le, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return [*out, f"{name}_sum {self.sum}", f"{name}_count {total}"]  # (+Inf's: one scrape, one count)


@dataclass
class Metrics:
    """Counters and gauges for /metrics (read by the HTTP thread; plain ints and floats, no locks needed)."""

    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a cache row already held (no prefill)
    generated_tokens: int = 0
    steps: int = 0
    row_steps: int = 0  # live rows summed over steps
    step_tokens: int = 0  # tokens those steps emitted: step_tokens / row_steps is tau
    step_seconds: float = 0.0
    running: int = 0
    waiting: int = 0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=512))  # (time, tokens)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        pts = [(t, n) for t, n in list(self.recent) if now - t <= window]
        if len(pts) < 2:
            return 0.0
        return sum(n for _, n in pts[1:]) / max(pts[-1][0] - pts[0][0], 1e-9)


def prometheus(m: Metrics) -> str:
    """The Prometheus text exposition of `m`."""
    rows = [
        ("k26_requests_total", "counter", "requests accepted into the queue (a row per choice)", m.requests),
        ("k26_requests_finished_total", "counter", "requests that ran to a finish reason", m.finished),
        (
            "k26_requests_cancelled_total",
            "counter",
            "rows cancelled: their client went away, or a sibling choice failed",
            m.cancelled,
        ),
        ("k26_requests_rejected_total", "counter", "rows refused with 429 (queue full)", m.rejected),
        ("k26_prompt_tokens_total", "counter", "prompt tokens admitted", m.prompt_tokens),
        (
            "k26_prefix_cache_hit_tokens_total",
            "counter",
            "prompt tokens a cache row already held (reused, not prefilled)",
            m.cached_tokens,
        ),
        ("k26_generation_tokens_total", "counter", "tokens generated", m.generated_tokens),
        ("k26_steps_total", "counter", "decode steps (one target forward each)", m.steps),
        ("k26_step_seconds_total", "counter", "seconds spent in decode steps", m.step_seconds),
        (
            "k26_generation_tokens_per_second",
            "gauge",
            "tokens generated per second, last 10 s",
            m.tokens_per_second(),
        ),
        (
            "k26_tau",
            "gauge",
            "tokens per row per step (accepted drafts + 1)",
            m.step_tokens / max(m.row_steps, 1),
        ),
        ("k26_step_seconds_mean", "gauge", "mean seconds per decode step", m.step_seconds / max(m.steps, 1)),
        ("k26_requests_running", "gauge", "requests in the batch", m.running),
        ("k26_requests_waiting", "gauge", "requests waiting for a free row", m.waiting),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    for name, help_, h in (
        (
            "k26_time_to_first_token_seconds",
            "arrival to the first token (queueing and prefill included)",
            m.ttft,
        ),
        ("k26_time_per_output_token_seconds", "a request's mean time between tokens after its first", m.tpot),
        ("k26_request_seconds", "arrival to the finish reason", m.e2e),
    ):
        out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *h.lines(name)]
    return "\n".join(out) + "\n"
