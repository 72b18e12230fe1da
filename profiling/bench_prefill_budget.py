"""Deferred prefill benchmark: how long a running stream stalls while a long prompt arrives, and that prompt's
time to first token, per prefill budget (positions prefilled per decode step while rows decode).

Through the batch API the server's engine thread uses: `--streams` rows decode; at step 5 a prompt of
`--prompt-len` tokens is admitted with `wait=False`; every step is timed. Per budget: the longest step the
running streams saw (their worst inter-token gap), the median step, the long prompt's TTFT (from its
admission to its first token) and the number of steps it took. The largest budget is the prompt prefilled
in one go (the behaviour before deferred prefill).

    python profiling/bench_prefill_budget.py --device cpu --dtype float32 --out profiling/results/DATE.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import add_model_args, device_name, make_llm, sync
from timing import report

from k26 import LLM, SamplingParams, SpecConfig
from k26.train import corpus


def run(llm: LLM, spec, budget: int, streams: list[list[int]], long: list[int], steps: int) -> dict:
    llm.decoder.ctx.prefill_budget = budget
    llm.decoder.ctx.prefix_cache = False  # every run prefills the whole prompt
    llm.open_batch(spec)
    sp = SamplingParams(max_tokens=10_000, stop_token_ids=[])
    rows = llm.admit(streams, [sp] * len(streams))
    times, admitted, first, slot = [], None, None, None
    for k in range(steps):
        if k == 5:
            sync(llm.device)
            admitted = time.perf_counter()
            (slot,) = llm.admit([long], [SamplingParams(max_tokens=4, stop_token_ids=[])], wait=False)
        sync(llm.device)
        t0 = time.perf_counter()
        llm.step()
        sync(llm.device)
        now = time.perf_counter()
        times.append(now - t0)
        if slot is not None and first is None and llm.batch.outs[slot].token_ids:
            first, first_step = now, k
    for s in [*rows, slot]:
        llm.release(s)
    after = times[5:]
    return {
        "budget": budget,
        "worst": max(after),
        "median": statistics.median(after),
        "ttft": (first - admitted) if first else float("nan"),
        "steps": (first_step - 5 + 1) if first else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--budgets", default="256,512,1024,1000000")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-model-len", type=int, default=3072)
    ap.add_argument("--out")
    a = ap.parse_args()
    llm = make_llm(a, a.streams + 1, a.max_model_len)
    spec = SpecConfig("ddtree", 6) if llm.drafter is not None else SpecConfig("ar")
    ids = llm.tokenizer.encode(corpus.text("eval"))
    gen = torch.Generator().manual_seed(0)
    streams = corpus.windows(ids, a.streams, 64, gen)
    (long,) = corpus.windows(ids, 1, a.prompt_len, gen)
    budgets = [int(b) for b in a.budgets.split(",")]
    run(llm, spec, budgets[0], streams, long, 8)  # warm-up
    rows = [run(llm, spec, b, streams, long, a.steps) for b in budgets]
    name = device_name(llm.device)
    lines = [
        f"# bench_prefill_budget — {time.strftime('%Y-%m-%d')}",
        "",
        f"- device: {name}; model: {a.model or 'embedded pair'}; {spec.method}; dtype {a.dtype}",
        (
            f"- commit: {os.environ.get('K26_COMMIT', '?')}; command: "
            f"`python profiling/bench_prefill_budget.py {' '.join(sys.argv[1:])}`"
        ),
        (
            f"- {a.streams} streams decoding; at step 5 a {a.prompt_len}-token prompt arrives (admit "
            "wait=False); steps timed from there on (synchronised); the largest budget prefills it in one go"
        ),
        "",
        "| budget (positions / step) | worst step ms | median step ms | long prompt TTFT ms | its steps |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['budget']} | {r['worst'] * 1e3:.0f} | {r['median'] * 1e3:.0f} | {r['ttft'] * 1e3:.0f} | "
            f"{r['steps']} |"
        )
    report("\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
    main()
