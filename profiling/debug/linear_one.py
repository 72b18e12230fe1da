"""Runs `torch.ops.k26.linear` on one projection shape a few times, eagerly, over distinct weight copies: a
target for ncu (its cache flush between launches keeps every launch cold).

    ncu --clock-control none -k regex:linear_tile -s 3 -c 1 python profiling/debug/linear_one.py --m 16
(q_a + kv_a's shape by default; profiling/debug/ncu_linear.sh runs it in a snapshot.)
"""

import argparse

import torch

import k26.ops  # noqa: F401  (registers torch.ops.k26.linear)

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=2112, help="output features (weight rows): q_a + kv_a by default")
ap.add_argument("--k", type=int, default=7168, help="input features")
ap.add_argument("--m", type=int, default=1, help="token rows (tile mode serves up to 64)")
ap.add_argument("--calls", type=int, default=5)
a = ap.parse_args()
gen = torch.Generator(device="cuda").manual_seed(0)
ws = [torch.randn(a.n, a.k, device="cuda", generator=gen).to(torch.bfloat16) * 0.02 for _ in range(4)]
x = torch.randn(a.m, a.k, device="cuda", generator=gen).to(torch.bfloat16)
for i in range(a.calls):
    torch.ops.k26.linear(x, ws[i % len(ws)])
torch.cuda.synchronize()
