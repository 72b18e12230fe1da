"""Build kernels with their trace flag and print the phase stamps they leave in a device table
(`-DK26_ATTN_TRACE`, `-DK26_ROUTER_TRACE`, `-DK26_MOE_TRACE`): [rows (blocks or splits), 16 stamps] of
%globaltimer ns, 0 = not stamped. Shared by attn_trace.py, router_trace.py and moe_trace.py."""

import ctypes
import hashlib
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from k26.ops import build

ROWS, STAMPS = 1024, 16


def build_traced(sources: list[str], flags: list[str]) -> str:
    """A library of the named csrc/ sources built for sm_90a with `flags` (the trace defines), cached in the
    temp directory by the sources' and flags' hash; load it as the ops' library with K26_OPS_LIB."""
    paths = [build.CSRC / name for name in sources]
    h = hashlib.sha256(" ".join(flags).encode())
    for src in paths + sorted(build.CSRC.glob("*.cuh")):
        h.update(src.read_bytes())
    so = Path(tempfile.gettempdir()) / f"k26_traced_{h.hexdigest()[:16]}.so"
    if not so.exists():
        cmd = ["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", *flags]
        cmd += ["-gencode=arch=compute_90a,code=sm_90a", "-o", str(so), *map(str, paths)]
        subprocess.run(cmd, check=True)
    return str(so)


def read_tables(read: Callable[[ctypes.Array], int], tables: int = 1) -> torch.Tensor:
    """read(host) copies `tables` tables into `host` (returns a cudaError_t): ns, [tables, ROWS, STAMPS]."""
    host = (ctypes.c_ulonglong * (tables * ROWS * STAMPS))()
    assert read(host) == 0
    return torch.tensor(list(host), dtype=torch.float64).view(tables, ROWS, STAMPS)


def first_start(t: torch.Tensor) -> float:
    """The earliest stamp 0 of a table (ns)."""
    starts = t[..., 0][t[..., 0] > 0]
    return float(starts.min())


def print_table(t: torch.Tensor, names: dict[int, str], t0: float, rows: torch.Tensor | None = None) -> None:
    """Per named stamp of table t [ROWS, STAMPS]: how many rows set it and min / median / max µs after t0
    (rows: an optional bool mask of the rows to include)."""
    used = t[:, 0] > 0 if rows is None else (t[:, 0] > 0) & rows
    rel = torch.where(t > 0, (t - t0) / 1e3, torch.full_like(t, float("nan")))
    for k, name in names.items():
        col = rel[used, k]
        col = col[~col.isnan()]
        if col.numel():
            q = col.quantile(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)).tolist()
            print(f"{name:22s} n={col.numel():4d} min {q[0]:7.2f} median {q[1]:7.2f} max {q[2]:7.2f} µs")


def print_phases(read: Callable[[ctypes.Array], int], names: dict[int, str], header: str) -> None:
    """One kernel's table, µs from its first block's start."""
    t = read_tables(read)[0]
    print(f"{header} traced={int((t[:, 0] > 0).sum())}")
    print_table(t, names, first_start(t))
