"""Acceptance of the embedded default pair on held-out text: τ (tokens per target forward) for AR, the
DFlash chain and DDTree budgets, greedy and at temperature 1; tokens/s; held-out perplexity.

    python profiling/bench_acceptance.py [--model DIR --drafter DIR] [--device cpu|cuda] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time

import torch
import torch.nn.functional as F

from k26 import LLM, SamplingParams, SpecConfig
from k26.embedded import default_drafter_dir, default_model_dir
from k26.train import corpus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--drafter")
    ap.add_argument("--device", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--budgets", default="4,8,16,32,64,128")
    ap.add_argument("--out")
    a = ap.parse_args()
    model, drafter = a.model or default_model_dir(), a.drafter or default_drafter_dir()
    llm = LLM(model, drafter=drafter, device=a.device, progress=False, max_batch=8, max_model_len=1024)
    ids = llm.tokenizer.encode(corpus.text("eval"))
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - 256, (a.prompts,), generator=g).tolist()
    prompts = [ids[s : s + 48] for s in starts]
    with torch.no_grad():  # held-out perplexity over 16 windows of 256 tokens
        nll, n = 0.0, 0
        for s in starts:
            w = ids[s : s + 256]
            logits = llm.score(w[:-1])
            nll += F.cross_entropy(logits, torch.tensor(w[1:], device=logits.device), reduction="sum").item()
            n += len(w) - 1
    lines = [
        f"# bench_acceptance — {datetime.date.today()}",
        "",
        (
            f"- device: {llm.device}"
            f"{' (' + torch.cuda.get_device_name() + ')' if llm.device.type == 'cuda' else ''};"
            f" model {model}; drafter {drafter}; commit {os.environ.get('K26_COMMIT', '?')}"
        ),
        f"- held-out perplexity of the target: {math.exp(nll / n):.1f} ({n} tokens)",
        f"- {a.prompts} held-out prompts of 48 tokens, {a.tokens} new tokens each",
        f"- command: `python profiling/bench_acceptance.py --budgets {a.budgets}`",
        "",
        "| sampling | method | τ | tokens/s | speed-up vs AR |",
        "|---|---|---|---|---|",
    ]
    for temp in (0.0, 1.0):
        sp = SamplingParams(temperature=temp, max_tokens=a.tokens, stop_token_ids=[], seed=0)
        specs = [SpecConfig("ar"), SpecConfig("dflash")] + [
            SpecConfig("ddtree", int(b)) for b in a.budgets.split(",")
        ]
        base = None
        for spec in specs:
            llm.generate(
                prompts[:1], SamplingParams(max_tokens=4, stop_token_ids=[]), spec
            )  # warm up / capture
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, spec)
            dt = time.perf_counter() - t0
            toks = sum(len(o.token_ids) for o in outs)
            acc = [x for o in outs for x in o.stats.accepted_per_step]
            tau = sum(acc) / len(acc) if acc else 1.0
            base = base or toks / dt
            name = spec.method + (f" budget {spec.budget}" if spec.method == "ddtree" else "")
            lines.append(f"| T={temp} | {name} | {tau:.2f} | {toks / dt:.0f} | {toks / dt / base:.2f}x |")
            print(lines[-1], flush=True)
    sample = llm.generate(
        "def fibonacci(n):", SamplingParams(max_tokens=48, stop_token_ids=[]), SpecConfig("ddtree", 8)
    )[0]
    lines += [
        "",
        "Sample (greedy, DDTree budget 8, prompt `def fibonacci(n):`):",
        "",
        "```python",
        "def fibonacci(n):" + sample.text,
        "```",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
