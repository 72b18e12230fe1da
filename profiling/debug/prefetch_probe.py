"""Does an L2 prefetch launch pay off in front of a latency-bound kernel? Graph replays (cold L2) of: the
prefetch launch alone (bulk vs per-line, 0 / 16.7 MB: does a block retire before its prefetches land?), the
tree attention (4K, N = 1 / 16, rotary query) alone and after a prefetch of o_proj + kv_b, and the o_proj
linear alone / after attention / after prefetch + attention (the bytes it then finds in L2).

    python profiling/debug/prefetch_probe.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_tree_attn import inputs
from timing import graph_time_cold

from k26.ops import prefetch_cuda

gen = torch.Generator(device="cuda").manual_seed(0)
ticket = torch.zeros(1, dtype=torch.int32, device="cuda")
o_proj = torch.randn(7168, 1024, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
kv_b = torch.randn(8 * 256, 512, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
weights = [o_proj, kv_b]


def us(fn) -> float:
    return graph_time_cold(fn, reps=40) * 1e6


def pf(ws):
    return lambda: torch.ops.k26.l2_prefetch(ticket, ws)


for lines in (False, True):
    prefetch_cuda.LINES = lines
    print(
        f"prefetch kernel alone ({'per line' if lines else 'bulk'}): empty {us(pf([])):.1f} µs, "
        f"1 MB {us(pf([kv_b])):.1f}, 16.7 MB {us(pf(weights)):.1f}"
    )
for N in (1, 16):
    args, rot, _ = inputs(1, N, 8, 4096, gen, rotary=True)
    x = torch.randn(N, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)

    def attn(args=args, rot=rot):
        return torch.ops.k26.mla_tree_attention(*args, 0.1, 512, *rot)

    def lin(x=x):
        return torch.ops.k26.linear(x, o_proj)

    rows = {"attention": attn, "o_proj linear": lin, "attention + o_proj": lambda: (attn(), lin())}
    for lines in (False, True):
        prefetch_cuda.LINES = lines
        tag = "lines" if lines else "bulk"
        rows[f"prefetch({tag}) + attention"] = lambda: (pf(weights)(), attn())
        rows[f"prefetch({tag}) + attention + o_proj"] = lambda: (pf(weights)(), attn(), lin())
        rows[f"prefetch({tag}, empty) + attention"] = lambda: (pf([])(), attn())
        for name in [k for k in rows if tag in k]:
            print(f"N={N:2d} {name:40s} {us(rows.pop(name)):6.1f} µs")
    for name, fn in rows.items():
        print(f"N={N:2d} {name:40s} {us(fn):6.1f} µs")
print("ticket", int(ticket))
