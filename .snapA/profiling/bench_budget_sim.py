"""Adaptive vs fixed DDTree budgets — a SIMULATION with K2.6-scale step costs (CPU, labelled as such).

    python profiling/bench_budget_sim.py [--prompts 24 --tokens 64] [--out FILE.md]

Acceptance is real: the embedded trained pair (k26/default: target + DFlash drafter, GPU-trained) decodes
held-out text at batch 1, greedy and at temperature 1, so the drafter's confidences are a trained
drafter's. Time is modelled: each step is charged the whole-step cost measured for its budget on the
61-layer K2.6 TP8 rank (H200), in two measured profiles —
  compiled, 4K context (2026-11-30-bench_k26-compile-h200.md): budget 8 → 17.22 ms, 15 → 18.29, 31 → 22.10
  eager, 32K context (2026-11-30-bench_k26-h200.md):             budget 8 → 30.72 ms, 15 → 34.93, 31 → 43.05
tokens/s = emitted tokens / charged time. `auto` is given the same per-budget costs as its cost table.

A third workload mixes context lengths, as a server's requests do: prompt i is charged as if it sat at
4K, 32K or 128K context (round robin), cost(b, L) = compiled-4K cost + s_b (L - 4096), with s_b the
per-token slope of the eager 4K -> 32K measurements (the tree-attention term; the same kernel runs eager
and compiled; the line predicts the measured 128K budget-15 step, 58.6 ms eager, to 1.5 %). `auto` gets
cost(b, L_i) before each prompt — what its per-token cost term computes from the live rows' lengths (the
tiny pair's real contexts are ~100 tokens, so the sim sets it); `auto, one length` keeps the 4K table for
every prompt, as a policy timed at one context length would.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch

from k26 import LLM, SamplingParams, SpecConfig
from k26.train import corpus

PROFILES = {
    "K2.6 compiled, 4K": {8: 17.22, 15: 18.29, 31: 22.10},
    "K2.6 eager, 32K": {8: 30.72, 15: 34.93, 31: 43.05},
}
EAGER_4K = {8: 24.90, 15: 28.24, 31: 30.87}  # 2026-11-30-bench_k26-h200.md, same run as eager 32K
SLOPE = {b: (PROFILES["K2.6 eager, 32K"][b] - EAGER_4K[b]) / (32768 - 4096) for b in EAGER_4K}  # ms per token
CONTEXTS = (4096, 32768, 131072)
MIXED = "K2.6 compiled, mixed 4K / 32K / 128K"


def cost_at(b: int, ctx: int) -> float:
    return PROFILES["K2.6 compiled, 4K"][b] + SLOPE[b] * (ctx - 4096)


def run(llm, prompts, sp, spec, before=None) -> tuple[list[int], list[int], list[int]]:
    """Accepted tokens, budget and prompt index per step over all prompts, one at a time (batch 1)."""
    acc, used, which = [], [], []
    for i, p in enumerate(prompts):
        if before is not None:
            before(i)
        o = llm.generate([p], sp, spec)[0]
        acc += o.stats.accepted_per_step
        used += o.stats.budgets or [spec.budget] * len(o.stats.accepted_per_step)
        which += [i] * len(o.stats.accepted_per_step)
    return acc, used, which


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    llm = LLM(device="cpu", dtype=torch.float32, progress=False, max_batch=1, max_model_len=512)
    ids = llm.tokenizer.encode(corpus.text("eval"))
    prompts = corpus.windows(ids, a.prompts, 48, torch.Generator().manual_seed(1), room=16)
    lines = [
        f"# bench_budget_sim — {datetime.date.today()} (SIMULATION: real acceptance, modelled time)",
        "",
        (
            f"- acceptance: the embedded trained pair on {a.prompts} held-out prompts, "
            f"{a.tokens} new tokens, batch 1, CPU fp32 [measured]"
        ),
        "- time: whole-step cost per budget measured on the 61-layer K2.6 TP8 rank (H200) [charged per step]",
        f"- commit: {os.environ.get('K26_COMMIT', '?')}; command: `python profiling/bench_budget_sim.py`",
        "",
        "| sampling | cost profile | budget | τ | simulated tokens/s | vs best fixed | budgets used |",
        "|---|---|---|---|---|---|---|",
    ]
    for temp in (0.0, 1.0):
        sp = SamplingParams(temperature=temp, max_tokens=a.tokens, stop_token_ids=[], seed=0)
        fixed = {b: run(llm, prompts, sp, SpecConfig("ddtree", b)) for b in (8, 15, 31)}
        for name in (*PROFILES, MIXED):
            cands = (8, 15, 31)
            ctx = [CONTEXTS[i % 3] if name == MIXED else 0 for i in range(len(prompts))]
            table = {b: cost_at(b, 4096) for b in cands} if name == MIXED else PROFILES[name]
            llm.decoder.policies.clear()  # each workload calibrates from scratch
            spec = SpecConfig(
                "ddtree", "auto", candidates=cands, costs=(0.0, *(table[c] / 1e3 for c in cands))
            )
            results = dict(fixed)
            if name == MIXED:
                results["auto, one length"] = run(llm, prompts, sp, spec)
                llm.decoder.policies.clear()
                pol = llm.decoder.budgets.policy(spec, 1)

                def at_context(i, pol=pol, ctx=ctx, cands=cands):  # what the per-token term computes at L_i
                    pol.set_costs(0.0, [cost_at(c, ctx[i]) / 1e3 for c in cands])

                results["auto"] = run(llm, prompts, sp, spec, at_context)
            else:
                results["auto"] = run(llm, prompts, sp, spec)

            def charged(used, which, ctx=ctx, table=table, mixed=name == MIXED):
                return sum((cost_at(u, ctx[w]) if mixed else table[u]) for u, w in zip(used, which)) / 1e3

            rate = {b: sum(acc) / charged(used, which) for b, (acc, used, which) in results.items()}
            best = max(rate[b] for b in cands)
            for b, (acc, used, which) in results.items():
                counts = {c: used.count(c) for c in cands if c in used}
                lines.append(
                    f"| T={temp} | {name} | {b} | {sum(acc) / len(acc):.2f} | {rate[b]:.1f} | "
                    f"{rate[b] / best:.3f} | {counts} |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
