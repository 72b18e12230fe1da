"""Tree build on the device vs the CPU heap reference (the seed system's approach).

    python profiling/bench_tree.py [--calls 10] [--budgets 16,32,64] [--out FILE.md]

Vocabulary 163840 (K2.6), batch 1, depths 7 (block 8) and 15 (block 16), budgets 16..512. The vocab
top-K (`logprobs.topk(min(budget, V))`) is timed separately from the tree build proper; device times
are CUDA-graph replays (median), the heap is Python `heapq` on the CPU over the same top-K.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import graph_time, source_commit

from k26.spec.tree import build_ddtree_from_topk, build_ddtree_heap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--calls",
        type=int,
        default=1,
        help="tree builds per graph replay, back to back (the GPU's clocks stay up between them: a lone "
        "replay of a ~10 µs kernel reads ±5 µs from one process to the next on an H100)",
    )
    ap.add_argument("--budgets", default="16,32,64,128,256,512")
    a = ap.parse_args()
    if a.calls < 1:
        ap.error(f"--calls {a.calls}: expected at least 1")
    commit = source_commit()
    lines = [
        f"# bench_tree — {datetime.date.today()}",
        "",
        f"- device: {torch.cuda.get_device_name()}, torch {torch.__version__}",
        f"- commit: {commit}",
        f"- command: `python profiling/bench_tree.py --calls {a.calls} --budgets {a.budgets}`",
        "",
        (
            "| depth | budget | vocab top-K µs (GPU) | tree build µs (GPU, graph) | CPU heap µs "
            "| heap / GPU build |"
        ),
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    V = 163840
    for L in (7, 15):
        for budget in [int(x) for x in a.budgets.split(",")]:
            lp = torch.log_softmax(torch.randn(1, L, V, device="cuda") * 3, dim=-1)
            K = min(budget, V)
            t_topk = graph_time(lambda lp=lp, K=K: lp.topk(K, dim=-1), 1)
            top_lp, top_tok = lp.topk(K, dim=-1)
            t_build = graph_time(
                lambda lp=top_lp, tok=top_tok, b=budget: [
                    build_ddtree_from_topk(lp, tok, b) for _ in range(a.calls)
                ],
                a.calls,
            )
            cpu_lp = lp.cpu()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                build_ddtree_heap(cpu_lp, budget)
                times.append(time.perf_counter() - t0)
            t_heap = statistics.median(times)
            lines.append(
                f"| {L} | {budget} | {t_topk * 1e6:.1f} | {t_build * 1e6:.1f} | {t_heap * 1e6:.0f} | "
                f"{t_heap / t_build:.1f}x |"
            )
            print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
