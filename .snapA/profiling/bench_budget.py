"""Adaptive vs fixed DDTree budgets on the GPU, measured: the embedded trained pair, CUDA graphs, batch 1.

    python profiling/bench_budget.py [--prompts 16 --tokens 96 --rounds 3] [--compile] [--out FILE.md]

Every mode (each fixed candidate budget, and `auto` over the same candidates) decodes the same held-out
prompts one request at a time, interleaved per prompt (prompt 1 in every mode, then prompt 2, ...) so host
and clock drift hit all modes alike; the table reports the median over rounds. One untimed round first
captures every graph and lets `auto` measure its buckets and calibrate, as a server that has been running
would have.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch

from k26 import LLM, SamplingParams, SpecConfig
from k26.train import corpus

CANDIDATES = SpecConfig("ddtree", "auto").candidates


def one_round(llm: LLM, prompts, sp, specs: dict) -> dict[str, tuple[float, list[int], list[int]]]:
    """Per mode: seconds over all prompts (batch 1), accepted drafts per step, and budget per step."""
    out = {k: (0.0, [], []) for k in specs}
    for p in prompts:
        for k, spec in specs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = llm.generate([p], sp, spec)[0]
            torch.cuda.synchronize()
            dt, acc, used = out[k]
            out[k] = (dt + time.perf_counter() - t0, acc + o.stats.accepted_per_step, used + o.stats.budgets)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    # under graphs the tiny pair's reference attention reads whole cache rows: the row length sets how
    # steeply a step's cost grows with the tree (K2.6's kernel reads only the live prefix)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--extra", type=int, nargs="*", default=[], help="fixed budgets besides the candidates")
    ap.add_argument("--out")
    a = ap.parse_args()
    kw = {"max_batch": 1, "max_model_len": a.max_model_len}
    llm = LLM(device="cuda", graphs=True, compile=a.compile, progress=False, **kw)
    ids = llm.tokenizer.encode(corpus.text("eval"))
    prompts = corpus.windows(ids, a.prompts, 48, torch.Generator().manual_seed(3), room=16)
    fixed = sorted(set(CANDIDATES) | set(a.extra))
    specs = {str(b): SpecConfig("ddtree", b) for b in fixed} | {"auto": SpecConfig("ddtree", "auto")}
    lines = [
        f"# bench_budget — {datetime.date.today()} (measured: GPU wall-clock, CUDA graphs, batch 1)",
        "",
        (
            f"- device: {torch.cuda.get_device_name()}; commit {os.environ.get('K26_COMMIT', '?')}; "
            f"compile: {a.compile}"
        ),
        (
            f"- the embedded trained pair; {a.prompts} held-out prompts of 48 tokens, "
            f"{a.tokens} new tokens each, "
            f"one request at a time; median of {a.rounds} interleaved rounds after one untimed round"
        ),
        (
            f"- command: `python profiling/bench_budget.py --prompts {a.prompts} --tokens {a.tokens} "
            f"--rounds {a.rounds} --max-model-len {a.max_model_len}{' --compile' if a.compile else ''}"
            f"{' --extra ' + ' '.join(map(str, a.extra)) if a.extra else ''}`"
        ),
        "",
    ]
    for temp in (0.0, 1.0):
        sp = SamplingParams(temperature=temp, max_tokens=a.tokens, stop_token_ids=[], seed=0)
        one_round(llm, prompts, sp, specs)  # capture, measure the buckets, calibrate
        runs = {k: [] for k in specs}
        for _ in range(a.rounds):
            for k, r in one_round(llm, prompts, sp, specs).items():
                runs[k].append(r)
        pol = llm.decoder.policies[(specs["auto"], 1)]
        lines += [
            f"## T = {temp}",
            "",
            "auto's start-up timing per bucket (whole step at context 0 + per context "
            "token): "
            + ", ".join(
                f"{c}: {t * 1e3:.3f} ms + {s * 1e6:.2f} µs/token"
                for c, t, s in zip(pol.candidates, pol.t_verify, pol.slope.tolist())
            ),
            "",
            "| budget | τ | tokens/s (median) | rounds | vs best fixed | budgets used (last round) |",
            "|---|---|---|---|---|---|",
        ]
        tps = {k: [sum(acc) / dt for dt, acc, _ in r] for k, r in runs.items()}
        med = {k: statistics.median(v) for k, v in tps.items()}
        best = max(v for k, v in med.items() if k != "auto")
        for k, r in runs.items():
            _, acc, used = r[-1]
            counts = {c: used.count(c) for c in sorted(set(used))}
            lines.append(
                f"| {k} | {sum(acc) / len(acc):.2f} | {med[k]:.0f} | "
                f"{' / '.join(f'{x:.0f}' for x in tps[k])} | {med[k] / best:.3f} | {counts} |"
            )
            print(lines[-1], flush=True)
        lines.append("")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
