"""Prefix cache benchmark: multi-turn conversations, each turn's prompt the last turn's prompt and answer
plus a new user message, with the prefix cache on and off (the same LLM, a fresh batch each way).

C conversations run together in one open batch (`LLM.open_batch` / `admit` / `step` / `release`, what the
server's engine thread calls): each turn admits every conversation's next prompt at once, steps until all
have answered, releases them. Per turn: prompt tokens, tokens the cache held, time to first token (the
admission: copies, prefill of the rest, first token; synchronised) and the turn's wall time. Prompts are
held-out windows of the stdlib corpus, greedy decoding; "same answers": how many conversations' answers
the two runs gave alike (in bf16 a near-tie may flip: reused latents come from other forwards than a whole
prefill's, other batch shapes round differently).

    python profiling/bench_prefix.py --device cpu --dtype float32 --out profiling/results/DATE-prefix-cpu.md
"""

from __future__ import annotations

import argparse
import os
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


def converse(llm: LLM, spec: SpecConfig, system: list[int], turns: list[list[list[int]]], sp) -> list[dict]:
    """turns[t][c]: conversation c's user message at turn t. Per turn: prompt / cached tokens, TTFT, wall,
    and every conversation's answer."""
    llm.open_batch(spec)
    history = [list(system) for _ in turns[0]]
    rows = []
    for msgs in turns:
        prompts = [h + m for h, m in zip(history, msgs)]
        sync(llm.device)
        t0 = time.perf_counter()
        slots = llm.admit(prompts, [sp] * len(prompts))
        sync(llm.device)
        ttft = time.perf_counter() - t0
        while any(llm.batch.outs[s].finish_reason is None for s in slots):
            llm.step()
        sync(llm.device)
        wall = time.perf_counter() - t0
        outs = [llm.release(s) for s in slots]
        history = [p + o.token_ids for p, o in zip(prompts, outs)]
        rows.append(
            {
                "prompt": sum(map(len, prompts)),
                "cached": sum(o.cached_tokens for o in outs),
                "ttft": ttft,
                "wall": wall,
                "answers": [o.token_ids for o in outs],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--spec", default="ddtree", choices=["ar", "dflash", "ddtree"])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-len", type=int, default=512, help="a system prompt every conversation shares")
    ap.add_argument("--turn-len", type=int, default=64, help="tokens of each new user message")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out")
    a = ap.parse_args()
    llm = make_llm(a, a.conversations, a.max_model_len)
    spec = SpecConfig(a.spec, 6) if a.spec == "ddtree" else SpecConfig(a.spec)
    ids = llm.tokenizer.encode(corpus.text("eval"))
    gen = torch.Generator().manual_seed(0)
    system = corpus.windows(ids, 1, a.system_len, gen)[0]
    turns = [corpus.windows(ids, a.conversations, a.turn_len, gen) for _ in range(a.turns)]
    sp = SamplingParams(max_tokens=a.max_tokens, stop_token_ids=[])
    converse(llm, spec, system, turns[:1], SamplingParams(max_tokens=4))  # warm-up
    runs = {}
    for on in (False, True, False, True):  # interleaved: the second of each kept
        llm.decoder.ctx.prefix_cache = on
        runs[on] = converse(llm, spec, system, turns, sp)
    off, on = runs[False], runs[True]
    name = device_name(llm.device)
    lines = [
        f"# bench_prefix — {time.strftime('%Y-%m-%d')}",
        "",
        f"- device: {name}; model: {a.model or 'embedded pair'}; spec {a.spec}; dtype {a.dtype}",
        (
            f"- commit: {os.environ.get('K26_COMMIT', '?')}; command: `python profiling/bench_prefix.py "
            f"{' '.join(sys.argv[1:])}`"
        ),
        (
            f"- {a.conversations} conversations together, {a.turns} turns: a shared {a.system_len}-token "
            f"system prompt, {a.turn_len} new tokens per turn, {a.max_tokens} generated; TTFT = the "
            "admission of the turn's prompts (copies, prefill, first token)"
        ),
        "",
        (
            "| turn | prompt tokens | cached (on) | TTFT off ms | TTFT on ms | speed-up | turn off ms "
            "| turn on ms | same answers |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t, (x, y) in enumerate(zip(off, on)):
        lines.append(
            f"| {t + 1} | {y['prompt']} | {y['cached']} | {x['ttft'] * 1e3:.1f} | {y['ttft'] * 1e3:.1f} | "
            f"{x['ttft'] / y['ttft']:.2f}x | {x['wall'] * 1e3:.0f} | {y['wall'] * 1e3:.0f} | "
            f"{sum(a == b for a, b in zip(x['answers'], y['answers']))} / {len(x['answers'])} |"
        )
    tot = [sum(r["ttft"] for r in rs) for rs in (off, on)]
    total = f"Total TTFT: {tot[0] * 1e3:.0f} ms off, {tot[1] * 1e3:.0f} ms on ({tot[0] / tot[1]:.2f}x)."
    lines += ["", total]
    report("\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
    main()
