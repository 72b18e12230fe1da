"""Start-up progress and its record: one line per phase (read, repack, capture) on rank 0, and the same
figures as a `StartupReport` (`LLM.startup`, `python -m k26 info --startup`).

The lines are tqdm bars on stderr (stdout is the output), shown only when the caller asks (`progress`)
and stderr is a terminal: a log file or a pipe gets no carriage-return noise. Only rank 0 shows them:
in coordinated reads rank 0's byte counter already covers every rank's bytes (each round's all-to-all
tells every rank what all of them read), repack runs the same layers on every rank at once, and the
ranks capture in lockstep (a barrier per bucket); what differs per rank (bytes, seconds) is gathered
into the report over the process group instead of being printed by each rank.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import NamedTuple

from tqdm.auto import tqdm

_FORMAT = "{desc:<9}{percentage:3.0f}%|{bar:24}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"


def shows(progress: bool) -> bool:
    """Whether progress lines are drawn: asked for, and stderr is a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(progress) and isatty is not None and isatty()


def phase_bar(name: str, total: float, unit: str, progress: bool) -> tqdm:
    """One phase's line: `unit` "B" counts bytes (GB, GB/s, ETA); anything else counts items."""
    kw = {"unit_scale": True, "unit_divisor": 1000} if unit == "B" else {}
    return tqdm(
        total=total,
        desc=name,
        unit=unit,
        file=sys.stderr,
        leave=True,
        disable=not shows(progress),
        bar_format=_FORMAT,
        **kw,
    )


def phase_line(text: str, progress: bool) -> None:
    """A phase with nothing to count while it runs (repack: one short pass per layer) says when it is done."""
    if shows(progress):
        print(text, file=sys.stderr, flush=True)


class CaptureRecord(NamedTuple):
    """One captured CUDA graph: its bucket, the seconds its warm-ups + capture took, and the bytes the
    shared graph pool grew by (the largest bucket is captured first, so the smaller ones mostly reuse it)."""

    bucket: object  # graphs.buckets.Bucket (batch, nodes)
    seconds: float
    pool_bytes: int
    kind: str = ""  # e.g. "ddtree greedy": set by whoever captured it for several methods


@dataclass
class StartupReport:
    """What a start-up cost, per phase (seconds), per rank (bytes read, read seconds, bytes from disk) and
    per captured graph."""

    phases: dict[str, float] = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)  # one dict per TP rank, rank order
    captures: list[CaptureRecord] = field(default_factory=list)
    from_cache: bool = False

    @classmethod
    def gather(cls, stats, tp_size: int) -> StartupReport:
        """From a load's `ReadStats`, with every TP rank's figures gathered over the default process group
        (a collective: every rank calls it)."""
        mine = {"bytes_read": stats.bytes_read, "read_s": stats.seconds, "disk_bytes": stats.disk_bytes}
        ranks = [mine]
        if tp_size > 1:
            import torch.distributed as dist

            ranks = [None] * tp_size
            dist.all_gather_object(ranks, mine)
        return cls(dict(stats.phases), ranks, from_cache=stats.from_cache)

    @property
    def bytes_read(self) -> int:
        return sum(r.get("bytes_read", 0) for r in self.ranks)

    def lines(self) -> list[str]:
        """The report as text: a phase table, then one line per captured graph."""
        out = []
        if self.ranks:
            slowest = max(r.get("read_s", 0.0) for r in self.ranks)
            disk = [r.get("disk_bytes") for r in self.ranks]
            d = "n/a" if None in disk else f"{sum(disk) / 1e9:.2f} GB"
            src = "load cache" if self.from_cache else "checkpoint"
            out.append(
                f"read      {self.bytes_read / 1e9:.2f} GB of the {src} by {len(self.ranks)} rank(s), "
                f"slowest {slowest:.1f} s ({self.bytes_read / max(slowest, 1e-9) / 1e9:.2f} GB/s); "
                f"from disk {d}"
            )
        for k, v in self.phases.items():
            if k != "read":
                out.append(f"{k:<9} {v:.2f} s")
        for c in self.captures:
            kind = f"{c.kind} " if c.kind else ""
            out.append(
                f"  graph {kind}batch {c.bucket.batch} nodes {c.bucket.nodes}: {c.seconds:.2f} s, "
                f"pool +{c.pool_bytes / 1e6:.1f} MB"
            )
        return out
