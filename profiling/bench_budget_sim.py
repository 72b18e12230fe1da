"""Adaptive vs fixed DDTree budgets — a SIMULATION with K2.6-scale step costs (CPU, labelled as such).

    python profiling/bench_budget_sim.py [--out FILE.md]

Acceptance comes from the tiny model decoding for real (lossless, greedy) with a synthetic drafter that
knows the true continuation and ranks it first with probability 1 - noise, second (a near tie) with
probability 2·noise/3, and misses it otherwise — the trained tiny pair (issue 8) does not exist yet.
Time per step is not measured here: each step is charged the whole-step cost measured for its budget on
the 61-layer K2.6 rank at 4K context (profiling/results/2026-11-30-bench_k26-h200.md):
budget 8 → 24.90 ms, 15 → 28.24 ms, 31 → 30.87 ms. tokens/s = emitted tokens / charged time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import k26.spec.step as step_mod  # noqa: E402
from k26 import LLM, SamplingParams, SpecConfig  # noqa: E402
from k26.tiny import write_tiny_checkpoint, write_tiny_drafter  # noqa: E402
from test_spec import as_topk, oracle_draft  # noqa: E402

COST_MS = {8: 24.90, 15: 28.24, 31: 30.87}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    d = write_tiny_checkpoint(tempfile.mkdtemp(), seed=0)
    dr = write_tiny_drafter(tempfile.mkdtemp(), d, layers=1)
    llm = LLM(d, drafter=dr, device="cpu", dtype=torch.float32, progress=False, max_batch=8, max_model_len=512)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 380, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
               for _ in range(a.prompts)]
    sp = SamplingParams(max_tokens=a.tokens, stop_token_ids=[])
    ar = llm.generate(prompts, sp, SpecConfig("ar"))
    ref = {b: p + o.token_ids for b, (p, o) in enumerate(zip(prompts, ar))}
    cands = tuple(sorted(COST_MS))
    costs = (0.0, *(COST_MS[c] / 1e3 for c in cands))
    lines = [f"# bench_budget_sim — {datetime.date.today()} (SIMULATION)", "",
             "- acceptance: the tiny random model decoding greedily with a synthetic oracle drafter (see docstring)",
             "- time: measured K2.6-rank whole-step costs per budget (H200, 4K context), charged per step [modelled]",
             f"- commit: {os.environ.get('K26_COMMIT', '?')}; command: `python profiling/bench_budget_sim.py`", "",
             "| workload (draft noise) | budget | τ | simulated tokens/s | budgets used |", "|---|---|---|---|---|"]
    for noise in (0.05, 0.3, 0.6):
        for budget in (*cands, "auto"):
            torch.manual_seed(0)
            step_mod.draft_topk = as_topk(oracle_draft(ref, noise=noise, seed=int(noise * 100)))
            spec = SpecConfig("ddtree", budget, candidates=cands, costs=costs)
            llm.decoder.policies.clear()
            outs = llm.generate(prompts, sp, spec)
            assert [o.token_ids for o in outs] == [o.token_ids for o in ar], "lossless"
            steps = [b for o in outs for b in (o.stats.budgets or [budget] * len(o.stats.accepted_per_step))]
            acc = [n for o in outs for n in o.stats.accepted_per_step]
            t = sum(COST_MS[b] for b in steps) / 1e3  # every sequence charged its own steps
            tau, tps = sum(acc) / len(acc), sum(acc) / t
            used = {b: steps.count(b) for b in cands if b in steps}
            lines.append(f"| {noise} | {budget} | {tau:.2f} | {tps:.0f} | {used} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
