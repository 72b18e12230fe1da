"""Print the phase stamps a kernel built with its trace flag left in a device table (`-DK26_ATTN_TRACE`,
`-DK26_ROUTER_TRACE`): [1024 blocks or splits, 16 stamps] of %globaltimer ns, 0 = not stamped. Shared by
attn_trace.py and router_trace.py."""

import ctypes
from collections.abc import Callable

import torch

ROWS, STAMPS = 1024, 16


def print_phases(read: Callable[[ctypes.Array], int], names: dict[int, str], header: str) -> None:
    """read(host) copies the table into `host` (returns a cudaError_t); prints, per named stamp, how many
    blocks set it and min / median / max µs from the first block's start."""
    host = (ctypes.c_ulonglong * (ROWS * STAMPS))()
    assert read(host) == 0
    t = torch.tensor(list(host), dtype=torch.float64).view(ROWS, STAMPS)
    used = t[:, 0] > 0
    t0 = t[used, 0].min()
    rel = torch.where(t > 0, (t - t0) / 1e3, torch.full_like(t, float("nan")))
    print(f"{header} traced={int(used.sum())}")
    for k, name in names.items():
        col = rel[used, k]
        col = col[~col.isnan()]
        if col.numel():
            q = col.quantile(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)).tolist()
            print(f"{name:16s} n={col.numel():4d} min {q[0]:7.2f} median {q[1]:7.2f} max {q[2]:7.2f} µs")
