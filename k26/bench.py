"""`python -m k26 bench`: decode speed of one model in every mode, and `python -m k26 profile`.

Modes on the same checkpoint and prompts: AR eager, AR graphs, DFlash graphs, DDTree graphs (with a
drafter), and HF transformers `generate()` (what a user would try first; bf16 weights, eager). Reports
tokens/s, τ, host time per step, and capture time / memory per graph bucket, as a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import time
from pathlib import Path

import torch

from . import LLM, SamplingParams, SpecConfig


def _timed_generate(llm: LLM, prompts, sp, spec):
    llm.generate(prompts, SamplingParams(max_tokens=4, stop_token_ids=[]), spec)  # capture / warm up
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, spec)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    steps = max(len(o.stats.accepted_per_step) for o in outs) or max(len(o.token_ids) for o in outs)
    host = max(o.stats.host_s for o in outs)
    tau = sum(o.stats.tau for o in outs) / len(outs)
    return toks / dt, tau, host / max(steps, 1), outs


def _hf_baseline(model_dir: Path, prompts, max_tokens: int, device) -> float | None:
    try:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    except ImportError:
        return None
    from .hf_state import deepseek_v3_state

    text, state = deepseek_v3_state(model_dir, torch.bfloat16)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**text)).to(torch.bfloat16)
    model.load_state_dict(state, strict=True)
    model = model.to(device).eval()
    toks, dt = 0, 0.0
    for p in prompts:
        ids = torch.tensor([p], device=device)
        model.generate(ids, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt += time.perf_counter() - t0
        toks += out.shape[1] - len(p)
    return toks / dt


def run_bench(a: argparse.Namespace) -> str:
    from .embedded import default_drafter_dir, default_model_dir

    model_dir = Path(a.model) if a.model else default_model_dir()
    if not a.model and not a.drafter:
        a.drafter = default_drafter_dir()
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator().manual_seed(0)
    if a.model:  # an arbitrary checkpoint: random ids (its tokenizer's vocabulary is unknown here)
        prompts = [torch.randint(0, 300, (32,), generator=g).tolist() for _ in range(a.batch)]
    else:  # the embedded pair: held-out text, so τ means what it says
        from .tokenizer import Tokenizer
        from .train import corpus

        ids = Tokenizer.from_dir(model_dir).encode(corpus.text("eval"))
        prompts = corpus.windows(ids, a.batch, 32, g)
    sp = SamplingParams(max_tokens=a.max_tokens, stop_token_ids=[])
    rows = []
    kw = dict(device=dev, progress=False, max_batch=max(a.batch, 1), drafter=a.drafter, compile=a.compile)
    eager = LLM(model_dir, graphs=False, **{**kw, "compile": False})
    tps, tau, host, _ = _timed_generate(eager, prompts, sp, SpecConfig("ar"))
    rows.append(("AR eager", tps, tau, host))
    graphs = None
    if dev.type == "cuda":
        graphs = LLM(model_dir, graphs=True, **kw)
        modes = [SpecConfig("ar")]
        if a.drafter:
            modes += [SpecConfig("dflash"), SpecConfig("ddtree", a.budget), SpecConfig("ddtree", "auto")]
        for spec in modes:
            tps, tau, host, _ = _timed_generate(graphs, prompts, sp, spec)
            rows.append((f"{spec.method} graphs" + (f" (budget {spec.budget})" if spec.method == "ddtree" else ""),
                         tps, tau, host))
    hf = _hf_baseline(model_dir, prompts, a.max_tokens, dev) if not a.no_hf else None
    if hf:
        rows.append(("HF transformers generate()", hf, 1.0, float("nan")))
    commit = os.environ.get("K26_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    out = [f"# k26 bench — {datetime.date.today()}", "",
           f"- device: {name}; model: {model_dir}; drafter: {a.drafter}; commit: {commit}; compile: {a.compile}",
           f"- command: `python -m k26 bench --batch {a.batch} --max-tokens {a.max_tokens} --budget {a.budget}`",
           "", "| mode | tokens/s | τ | host µs / step |", "|---|---|---|---|"]
    out += [f"| {m} | {t:.0f} | {tau:.2f} | {h * 1e6:.0f} |" for m, t, tau, h in rows]
    if graphs is not None:
        out += ["", "| graph bucket (batch, nodes) | capture s | pool MB |", "|---|---|---|"]
        for runner in graphs.decoder.runners.values():
            out += [f"| ({b.batch}, {b.nodes}) | {s:.2f} | {m / 1e6:.1f} |" for b, s, m in runner.report]
    return "\n".join(out) + "\n"


def run_profile(a: argparse.Namespace) -> str:
    """A torch.profiler trace of a short generation (nsys may be absent): Chrome trace JSON."""
    from torch.profiler import ProfilerActivity, profile

    from .embedded import default_model_dir

    llm = LLM(a.model or default_model_dir(), drafter=a.drafter, device=a.device, progress=False)
    spec = SpecConfig(a.spec, a.budget if a.spec == "ddtree" else None)
    sp = SamplingParams(max_tokens=a.max_tokens, stop_token_ids=[])
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), spec)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        llm.generate([[1, 2, 3, 4]], sp, spec)
    prof.export_chrome_trace(a.out)
    return prof.key_averages().table(sort_by="self_cuda_time_total" if llm.device.type == "cuda" else "self_cpu_time_total",
                                     row_limit=20)
