"""Two-GPU tensor-parallel check and collective latency (torchrun --nproc-per-node 2).

    torchrun --nproc-per-node 2 profiling/bench_tp2.py --out FILE.md

1. In-graph vs eager NCCL all-reduce latency for 7168 x N bf16 (N = 1..256), 50 calls per graph.
2. The embedded pair at TP 2 (bf16): greedy tokens with graphs == without graphs, DDTree == AR, and the
   batch-1 graph step time; then `python profiling/bench_tp2.py --tp1 FILE.md.json --out FILE.md` runs TP 1
   on one GPU and appends tokens TP 2 == TP 1 and the step times side by side.
Exits with os._exit once results are written: NCCL teardown after graph capture can hang (gpu-targets.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from timing import events_time as events

DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def run_pair(device: str, tp: int, dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    """Greedy tokens (graphs and eager, AR and DDTree) and batch-1 graph step times of the embedded pair."""
    from k26 import LLM, SamplingParams, SpecConfig

    sp = SamplingParams(max_tokens=48, stop_token_ids=[])
    res, times = {}, {}
    # fp32 runs eager only: the int4 MoE kernel takes bf16 activations, and its fp32 reference is not
    # capturable
    for graphs in (True, False) if dtype == torch.bfloat16 else (False,):
        llm = LLM(
            device=device, tp=tp, dtype=dtype, graphs=graphs, progress=False, max_batch=2, max_model_len=512
        )
        for spec in (SpecConfig("ar"), SpecConfig("ddtree", 8)):
            res[f"{'graphs' if graphs else 'eager'} {spec.method}"] = [
                o.token_ids for o in llm.generate(PROMPTS, sp, spec)
            ]
            if graphs:  # batch 1, after the batch-2 run captured and warmed the buckets
                llm.generate(PROMPTS[:1], sp, spec)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = llm.generate(PROMPTS[:1], sp, spec)[0]
                torch.cuda.synchronize()
                times[f"{spec.method} step"] = (time.perf_counter() - t0) / len(out.stats.accepted_per_step)
        if (
            tp == 1
        ):  # at TP 2 the group is the benchmark's (made before the all-reduce part): it outlives the LLMs
            llm.close()
    return res, times


def same(res: dict, a: str, b: str) -> str:
    return "n/a (eager only)" if a not in res else str(res[a] == res[b])


def tp1_check(tp2_json: str, out: str | None) -> None:
    """Rank 0's view of TP 1 on one GPU against the TP 2 run's saved tokens and step times."""
    with open(tp2_json) as f:
        saved = json.load(f)
    res, times = run_pair("cuda", tp=1, dtype=DTYPE[saved["dtype"]])
    lines = ["", f"| TP 2 vs TP 1 (same pair, {saved['dtype']}, greedy) | |", "|---|---|"]
    lines += [f"| {k}: tokens TP 2 == TP 1 | {saved['res'][k] == v} |" for k, v in res.items()]
    lines += [
        f"| {k}: ms TP 1 / TP 2 | {v * 1e3:.3f} / {saved['times'][k] * 1e3:.3f} |" for k, v in times.items()
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtype", choices=sorted(DTYPE), default="bf16")
    ap.add_argument("--tp1", metavar="TP2_JSON", help="run TP 1 alone and compare with a TP 2 run's tokens")
    a = ap.parse_args()
    if a.tp1:
        return tp1_check(a.tp1, a.out)
    from k26.dist import init_from_env

    rank, world, dev = init_from_env("cuda")
    lines = [
        f"# bench_tp2 — {datetime.date.today()}",
        "",
        f"- device: {world} x {torch.cuda.get_device_name()}; commit {os.environ.get('K26_COMMIT', '?')}",
        "- command: `torchrun --nproc-per-node 2 profiling/bench_tp2.py`",
        "",
        "| message (7168 x N bf16) | in-graph all-reduce µs | eager µs |",
        "|---|---|---|",
    ]
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
        t_eager = events(lambda x=x: dist.all_reduce(x))
        lines.append(
            f"| N = {N} ({N * 7168 * 2 / 1024:.0f} KiB) | {t_graph * 1e6:.1f} | {t_eager * 1e6:.1f} |"
        )
    res, times = run_pair(str(dev), tp=2, dtype=DTYPE[a.dtype])
    if rank == 0:
        lines += [
            "",
            f"| TP 2, embedded pair ({a.dtype}), greedy | tokens equal |",
            "|---|---|",
            f"| AR graphs == AR eager | {same(res, 'graphs ar', 'eager ar')} |",
            f"| DDTree graphs == DDTree eager | {same(res, 'graphs ddtree', 'eager ddtree')} |",
            f"| DDTree eager == AR eager (lossless) | {res['eager ddtree'] == res['eager ar']} |",
            "",
            "| TP 2 graphs, batch 1 | ms / step |",
            "|---|---|",
        ]
        lines += [f"| {k} | {v * 1e3:.3f} |" for k, v in times.items()]
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if a.out:  # closed here, before os._exit below (which skips Python's cleanup)
            with open(a.out, "w") as f:
                f.write(text)
            with open(a.out + ".json", "w") as f:
                json.dump({"res": res, "times": times, "dtype": a.dtype}, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
