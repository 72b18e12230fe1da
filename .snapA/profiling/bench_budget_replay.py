"""How much can any budget policy win? Counterfactual replay of recorded DDTree steps (CPU, SIMULATION).

    python profiling/bench_budget_replay.py [--prompts 64 --tokens 96] [--out FILE.md]

The embedded trained pair decodes held-out prompts at the largest candidate budget; every step's tree
and accepted path are recorded. A smaller budget's tree is a prefix of the recorded one and its accepted
path is the part of the recorded path inside the prefix, so every step's outcome under every candidate is
known (exactly for greedy; for T = 1 with the same target draws). On these steps, charged the measured
K2.6 step costs of `bench_budget_sim`, the replay compares:
  fixed      each candidate budget on every step;
  oracle     the best per-step choice with hindsight (long-run-rate rule on the true outcomes): the ceiling;
  linear     a least-squares predictor of each candidate's accepted length from cheap tree features
             (prefix masses, per-depth masses, squares), fitted on one half and applied to the other:
             the ceiling of what the drafter's confidences can predict;
  policy     the shipped `BudgetPolicy`, run online over the steps (whole run, and 600-step windows).
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
from bench_budget_sim import PROFILES  # the measured K2.6-rank step costs, one table

import k26.spec.step as step_mod
from k26 import LLM, SamplingParams, SpecConfig
from k26.spec.budget import BudgetPolicy
from k26.train import corpus

CANDS = (8, 15, 31)


def record(llm, prompts, sp) -> list:
    """(tree, path) of every step at the largest budget, batch 1."""
    steps, walk = [], step_mod.accept_walk

    def recording(tree, choice):
        path, n, bonus = walk(tree, choice)
        steps.append((tree, path))
        return path, n, bonus

    step_mod.accept_walk = recording
    try:
        for p in prompts:
            llm.generate([p], sp, SpecConfig("ddtree", CANDS[-1]))
    finally:
        step_mod.accept_walk = walk
    return steps


def outcomes(steps) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, C] accepted drafts under each candidate, and [S, F] cheap features of each step's tree."""
    acc, feat = [], []
    for tree, path in steps:
        p = path[0, 1:]
        acc.append([int(((p >= 1) & (p <= b)).sum()) for b in CANDS])
        q = torch.where(tree.valid[0, 1:], tree.scores[0, 1:].float().exp(), 0.0)
        mass = [float(q[:b].sum()) for b in CANDS]
        depth = [float(q[tree.depths[0, 1:] == d].sum()) for d in range(1, 8)]
        feat.append(mass + depth + [m * m for m in mass] + [d * d for d in depth[:3]])
    return torch.tensor(acc, dtype=torch.float), torch.tensor(feat)


def rate(acc, pick, cost) -> float:
    c = torch.tensor([cost[b] for b in CANDS])
    return float((acc.gather(1, pick[:, None]) + 1).sum() / c[pick].sum() * 1e3)


def long_run_rule(gain, cost) -> torch.Tensor:
    """Per-step argmax of gain - R * cost at the fixed point R of the resulting rate (Dinkelbach)."""
    c = torch.tensor([cost[b] for b in CANDS])
    r = float((gain.mean(0) / c).max())
    for _ in range(50):
        pick = (gain - r * c).argmax(1)
        r = float(gain.gather(1, pick[:, None]).sum() / c[pick].sum())
    return pick


def linear(acc, feat, cost) -> torch.Tensor:
    n, h = len(acc), len(acc) // 2
    A = torch.cat([torch.ones(n, 1), feat], 1)
    pred = torch.zeros_like(acc)
    for fit, use in ((slice(0, h), slice(h, n)), (slice(h, n), slice(0, h))):
        pred[use] = A[use] @ torch.linalg.lstsq(A[fit], acc[fit]).solution
    return long_run_rule(pred + 1, cost)


def replay(steps, acc, cost) -> torch.Tensor:
    pol = BudgetPolicy.create(CANDS, 0.0, [cost[b] / 1e3 for b in CANDS], "cpu")
    alive, picks = torch.ones(1, dtype=torch.bool), []
    for (tree, path), a in zip(steps, acc):
        i = int(pol.choose(tree, alive))
        inside = torch.where((path >= 0) & (path <= CANDS[i]), path, -1)
        pol.update(tree, torch.tensor(i), a[i : i + 1].long(), alive, inside)
        picks.append(i)
    return torch.tensor(picks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out")
    a = ap.parse_args()
    llm = LLM(device="cpu", dtype=torch.float32, progress=False, max_batch=1, max_model_len=512)
    ids = llm.tokenizer.encode(corpus.text("eval"))
    prompts = corpus.windows(ids, a.prompts, 48, torch.Generator().manual_seed(7), room=16)
    lines = [
        f"# bench_budget_replay — {datetime.date.today()} (SIMULATION: recorded steps, modelled time)",
        "",
        (
            f"- steps: the embedded trained pair at budget {CANDS[-1]} on {a.prompts} held-out prompts, "
            f"{a.tokens} new tokens, batch 1, CPU fp32 [measured]; "
            "costs: the K2.6 profiles of bench_budget_sim [charged]"
        ),
        (
            f"- commit: {os.environ.get('K26_COMMIT', '?')}; "
            f"command: `python profiling/bench_budget_replay.py --prompts {a.prompts} --tokens {a.tokens}`"
        ),
        "",
        "All columns are tokens/s relative to the best fixed budget on the same steps.",
        "",
        "| sampling | cost profile | steps | fixed "
        + " / ".join(map(str, CANDS))
        + " | oracle (ceiling) | linear predictor (ceiling of features) | policy, whole run | "
        "policy, 600-step windows: mean (min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for temp in (0.0, 1.0):
        sp = SamplingParams(temperature=temp, max_tokens=a.tokens, stop_token_ids=[], seed=0)
        steps = record(llm, prompts, sp)
        acc, feat = outcomes(steps)
        n = len(acc)
        for name, cost in PROFILES.items():
            fixed = [rate(acc, torch.full((n,), i), cost) for i in range(len(CANDS))]
            best = max(fixed)
            wins = []
            for s in range(0, n - 600 + 1, 300):
                w = acc[s : s + 600]
                wb = max(rate(w, torch.full((600,), i), cost) for i in range(len(CANDS)))
                wins.append(rate(w, replay(steps[s : s + 600], w, cost), cost) / wb)
            row = (
                f"| T={temp} | {name} | {n} | {' / '.join(f'{f / best:.3f}' for f in fixed)} | "
                f"{rate(acc, long_run_rule(acc + 1, cost), cost) / best:.3f} | "
                f"{rate(acc, linear(acc, feat, cost), cost) / best:.3f} | "
                f"{rate(acc, replay(steps, acc, cost), cost) / best:.3f} | "
                + (f"{sum(wins) / len(wins):.3f} ({min(wins):.3f}) |" if wins else "— |")
            )
            lines.append(row)
            print(row, flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
