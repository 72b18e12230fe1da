"""Soak: many speculative steps with context resets; GPU and host memory must stay flat.

    python profiling/soak.py [--steps 10000] [--out FILE.md]

Runs DDTree graph steps over rotating prompts on the embedded default pair until the step count is
reached, sampling GPU allocated/reserved memory and the process RSS every 1000 steps.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import time

import torch

from k26 import LLM, SamplingParams, SpecConfig
from k26.embedded import default_drafter_dir, default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = default_model_dir()
    drafter = default_drafter_dir()
    llm = LLM(model, drafter=drafter, device="cuda", progress=False, max_batch=4, max_model_len=1024)
    g = torch.Generator().manual_seed(0)
    steps, rows, nxt, t0 = 0, [], 1000, time.perf_counter()
    while steps < a.steps:
        prompts = [
            torch.randint(0, 300, (int(torch.randint(4, 64, (1,), generator=g)),), generator=g).tolist()
            for _ in range(4)
        ]
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=200, stop_token_ids=[]), SpecConfig("ddtree", 12)
        )
        steps += max(len(o.stats.accepted_per_step) for o in outs)
        if steps >= nxt:
            torch.cuda.synchronize()
            rows.append(
                (
                    steps,
                    time.perf_counter() - t0,
                    torch.cuda.memory_allocated() / 1e6,
                    torch.cuda.memory_reserved() / 1e6,
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
                )
            )
            print(rows[-1], flush=True)
            nxt += 1000
    text = [
        f"# soak — {datetime.date.today()}",
        "",
        f"- device: {torch.cuda.get_device_name()}; commit: {os.environ.get('K26_COMMIT', 'unknown')}",
        f"- command: `python profiling/soak.py --steps {a.steps}`",
        "",
        "| steps | s | GPU allocated MB | GPU reserved MB | host max RSS MB |",
        "|---|---|---|---|---|",
    ]
    text += [f"| {s} | {t:.0f} | {al:.1f} | {re:.1f} | {rss:.0f} |" for s, t, al, re, rss in rows]
    print("\n".join(text))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
