"""Intra-op threads on a small CPU: one tiny-model score and one DDTree generate at 2 and 1 torch threads,
interleaved. Why the test suite runs one thread per process (tests/conftest.py) and CPU ranks take
cores // world (k26/tp_driver.py). Usage: python profiling/bench_cpu_threads.py"""

import os
import tempfile
import time

import torch

from k26 import LLM, SamplingParams, SpecConfig
from k26.tiny import write_tiny_checkpoint, write_tiny_drafter

d = write_tiny_checkpoint(tempfile.mkdtemp(), seed=4, moe_intermediate_size=128, shards=2)
dr = write_tiny_drafter(tempfile.mkdtemp(), d, layers=1, seed=2, heads=4, kv_heads=4)
ids = torch.randint(0, 600, (21,), generator=torch.Generator().manual_seed(0)).tolist()
llm = LLM(d, drafter=dr, device="cpu", dtype=torch.float32, progress=False, max_batch=2, max_model_len=128)
sp = SamplingParams(max_tokens=12, stop_token_ids=[])
rows = []
for nt in (2, 1, 2, 1):
    torch.set_num_threads(nt)
    llm.score(ids)
    t = time.perf_counter()
    llm.score(ids)
    s = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([ids[:9], ids[3:17]], sp, SpecConfig("ddtree", 6))
    g = time.perf_counter() - t
    rows.append((nt, s, g, os.getloadavg()[0]))
print("| threads | score 21 tokens (s) | DDTree generate 2x12 tokens (s) | load avg (1 min) |")
print("|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]:.3f} | {r[2]:.2f} | {r[3]:.1f} |")
