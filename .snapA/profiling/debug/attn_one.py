"""Runs `torch.ops.k26.mla_tree_attention` on one shape a few times, eagerly: a target for ncu.

ncu --clock-control none -k regex:tree_attn -s 3 -c 1 python profiling/debug/attn_one.py --n 1 --l 131072
"""

import argparse

import torch

from k26.ops import tree_mask_to_words

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=1)
ap.add_argument("--h", type=int, default=8)
ap.add_argument("--l", type=int, default=131072)
a = ap.parse_args()
gen = torch.Generator(device="cuda").manual_seed(0)
cache = torch.randn(1, a.l + a.n, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
q = torch.randn(1, a.n, a.h, 576, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.3
words = tree_mask_to_words(torch.ones(1, a.n, a.n, dtype=torch.bool).tril()).cuda()
rows, prefix = torch.zeros(1, dtype=torch.long, device="cuda"), torch.full((1,), a.l, device="cuda")
for _ in range(5):
    torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, 0.1, 512)
torch.cuda.synchronize()
