"""`python -m k26 bench`: decode speed of one model in every mode, and `python -m k26 profile`.

Modes on the same checkpoint and prompts: AR eager, AR graphs, DFlash graphs, DDTree graphs (with a
drafter), and HF transformers `generate()` (what a user would try first; bf16 weights, eager). Reports
tokens/s, τ, host time per step, and capture time / memory per graph bucket, as a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import subprocess
import time
from pathlib import Path

import torch

from . import LLM, SamplingParams, SpecConfig

PROMPT_TOKENS = 32  # each bench prompt (the room --max-tokens has is the context less this)
PROFILE_PROMPT = [1, 2, 3, 4]  # the traced generation's prompt


def _timed_generate(llm: LLM, prompts, sp, spec, repeats: int = 3):
    """Tokens/s (median of `repeats` timed runs), τ, host seconds per step and the last run's outputs, after
    one untimed run of the same length: it captures / compiles, and the adaptive budget calibrates on it as
    it would in a server that has been running (a 4-token warm-up left `auto` timed while still learning)."""
    llm.generate(prompts, sp, spec)
    runs = []
    for _ in range(repeats):
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, spec)
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        runs.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    steps = max(len(o.stats.accepted_per_step) for o in outs) or max(len(o.token_ids) for o in outs)
    host = max(o.stats.host_s for o in outs)
    tau = sum(o.stats.tau for o in outs) / len(outs)
    return statistics.median(runs), tau, host / max(steps, 1), outs


def _budgets_used(outs) -> str:
    """DDTree budgets verified over a run's steps, {budget: steps} (— for a mode without a tree)."""
    used = [b for o in outs for b in o.stats.budgets]
    return str({b: used.count(b) for b in sorted(set(used))}) if used else "—"


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


def _prompts(a: argparse.Namespace, model_dir: Path) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    if a.model:  # an arbitrary checkpoint: random ids (its tokenizer's vocabulary is unknown here)
        return [torch.randint(0, 300, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(a.batch)]
    from .tokenizer import Tokenizer  # the embedded pair: held-out text, so τ means what it says
    from .train import corpus

    text = Tokenizer.from_dir(model_dir).encode(corpus.text("eval"))
    return corpus.windows(text, a.batch, PROMPT_TOKENS, g)


def _modes(a: argparse.Namespace, graphs: bool) -> list[tuple[str, SpecConfig]]:
    kind = "graphs" if graphs else "eager"
    modes = [(f"AR {kind}", SpecConfig("ar"))]
    if a.drafter:
        modes += [
            (f"DFlash {kind}", SpecConfig("dflash")),
            (f"DDTree {kind} (budget {a.budget})", SpecConfig("ddtree", a.budget)),
            (f"DDTree {kind} (auto)", SpecConfig("ddtree", "auto")),
        ]
    return modes


# Environment variables that change what a bench measures: the kernels' variant defines and library
# (k26/ops/build.py). The report's command sets them as they were.
RESULT_ENV = ("K26_OPS_DEFINES", "K26_OPS_LIB")


def bench_command(a: argparse.Namespace, dev: torch.device) -> str:
    """The shell command that reruns this bench: every `bench` option as parsed (the device as resolved, so a
    rerun on another machine measures the same kind; not --out, the report's own file), after the
    environment variables in RESULT_ENV that are set, shell-quoted."""
    from .cli_parser import build_parser

    argv = ["python", "-m", "k26", "bench"]
    for dest in vars(build_parser().parse_args(["bench"])):  # every option of `bench`, new ones too
        value = dev.type if dest == "device" else getattr(a, dest)
        if dest in ("cmd", "out") or value is None or value is False:
            continue
        argv += [f"--{dest.replace('_', '-')}"] + ([] if value is True else [str(value)])
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RESULT_ENV if os.environ.get(k)]
    return " ".join([*env, shlex.join(argv)])


def check_batch(a: argparse.Namespace, model_dir: Path, dev: torch.device) -> None:
    """--batch against what the run can hold, from the config files alone (before the prompts are drawn or
    anything loads): each LLM allocates its KV caches, target and drafter, for `max_batch` = --batch rows at
    the full context up front, and the bench keeps two (eager and graphs) on CUDA. Refused when those caches
    alone exceed the device's free memory (the weights and graph pools come on top)."""
    from .checks import default_max_model_len
    from .config import ModelConfig
    from .drafter_config import DrafterConfig
    from .memory_plan import cache_bytes, cache_rows_that_fit, free_memory

    free = free_memory(dev)
    if free is None:
        return
    cfg = ModelConfig.from_dir(model_dir)
    dcfg = DrafterConfig.from_dir(a.drafter) if a.drafter else None
    max_len, llms = default_max_model_len(cfg), 2 if dev.type == "cuda" else 1
    fit = cache_rows_that_fit(cfg, dcfg, max_len, torch.bfloat16, free // llms)
    if a.batch <= fit:
        return
    need = llms * cache_bytes(cfg, dcfg, a.batch, max_len, torch.bfloat16)
    where = "the GPU" if dev.type == "cuda" else "this machine"
    two = ", in each of the eager and the graphs LLM" if llms > 1 else ""
    limit = f"the largest --batch that fits is {fit}" if fit else "not even --batch 1 fits"
    raise ValueError(
        f"--batch {a.batch}: more rows than {where} can hold: their KV caches ({max_len} positions a row"
        f"{two}) need {need / 2**30:,.1f} GiB, and {where} has {free / 2**30:,.1f} GiB free; {limit}"
    )


def run_bench(a: argparse.Namespace) -> str:
    """Every mode this machine can run on one checkpoint and prompt set; what it cannot, listed with why."""
    from .embedded import default_drafter_dir, default_model_dir

    model_dir = Path(a.model) if a.model else default_model_dir()
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    command = bench_command(a, dev)  # as given (the embedded drafter below is implied by no --model)
    if not a.model and not a.drafter:
        a.drafter = default_drafter_dir()
    check_batch(a, model_dir, dev)
    prompts = _prompts(a, model_dir)
    sp = SamplingParams(max_tokens=a.max_tokens, stop_token_ids=[])
    kw = {"device": dev, "progress": False, "max_batch": max(a.batch, 1), "drafter": a.drafter}
    rows, skipped = [], []
    eager = LLM(model_dir, graphs=False, **kw)
    cuda = dev.type == "cuda"
    # Graph-less speculative rows only where there are no graphs: on CUDA the eager AR row is the baseline.
    for name, spec in _modes(a, graphs=False)[: 1 if cuda else None]:
        tps, tau, _, outs = _timed_generate(eager, prompts, sp, spec)
        rows.append((name, tps, tau, None, _budgets_used(outs)))  # eager steps: no host time (see report)
    graphs = None
    if cuda:
        graphs = LLM(model_dir, graphs=True, compile=a.compile, **kw)
        for name, spec in _modes(a, graphs=True):
            tps, tau, host, outs = _timed_generate(graphs, prompts, sp, spec)
            rows.append((name, tps, tau, host, _budgets_used(outs)))
    else:
        skipped.append("CUDA-graph rows (AR / DFlash / DDTree graphs, capture table): no CUDA device here")
        if a.compile:
            skipped.append("--compile: it applies to the graph rows")
    if not a.drafter:
        skipped.append("DFlash and DDTree rows: no drafter (pass --drafter DIR)")
    hf = None if a.no_hf else _hf_baseline(model_dir, prompts, a.max_tokens, dev)
    if hf:
        one = ", one prompt at a time" if a.batch > 1 else ""
        rows.append(
            (f"HF transformers generate() (eager, experts dequantised to bf16{one})", hf, 1.0, None, "—")
        )
    else:
        skipped.append(
            "HF transformers generate(): "
            + ("--no-hf" if a.no_hf else "transformers is not installed (pip install -e '.[test]')")
        )
    return _report(a, model_dir, dev, rows, skipped, graphs, command=command)


def _rate(tokens_per_s: float) -> str:
    """tokens/s as the table prints it: whole numbers from 100 up, else three significant figures (an eager
    CPU row's 0.4 tokens/s printed as 0 would read as nothing generated)."""
    return f"{tokens_per_s:.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"


def _report(
    a, model_dir: Path, dev: torch.device, rows, skipped: list[str], graphs: LLM | None, *, command: str
) -> str:
    commit = (
        os.environ.get("K26_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        or "?"
    )
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    cpu = " on the CPU" if dev.type == "cpu" else ""
    out = [
        f"# k26 bench — {datetime.date.today()}",
        "",
        f"- device: {name}; model: {model_dir}; drafter: {a.drafter}",
        f"- commit: {commit}; compile: {a.compile}",
        f"- command: `{command}`",
        (
            f"- every row: bf16, batch {a.batch}, same prompts, greedy, exactly {a.max_tokens} new tokens "
            f"each (no stop tokens); tokens/s: median of 3 timed runs after one untimed run of the same "
            f"length; eager rows run the pure-torch reference ops{cpu}"
        ),
        (
            "- host µs / step: CPU time of the graph loop between replays (graph rows only: an eager step's "
            "host time is inseparable from its compute, hence —)"
        ),
    ]
    out += [f"- skipped: {s}" for s in skipped]
    out += [
        "",
        "| mode | tokens/s | τ | host µs / step | budgets verified (steps) |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {m} | {_rate(t)} | {tau:.2f} | {'—' if h is None else f'{h * 1e6:.0f}'} | {u} |"
        for m, t, tau, h, u in rows
    ]
    if graphs is not None:
        out += ["", "| graph bucket (batch, nodes) | capture s | pool MB |", "|---|---|---|"]
        for runner in graphs.decoder.runners.values():
            out += [
                f"| ({r.bucket.batch}, {r.bucket.nodes}) | {r.seconds:.2f} | {r.pool_bytes / 1e6:.1f} |"
                for r in runner.report
            ]
    return "\n".join(out) + "\n"


def run_profile(a: argparse.Namespace) -> str:
    """A torch.profiler trace of a short generation (nsys may be absent): Chrome trace JSON whose phase
    ranges (prefill / draft / tree / verify / accept / replay) come from `k26.profiling.nvtx_range`."""
    from torch.profiler import ProfilerActivity, profile

    from .embedded import default_drafter_dir, default_model_dir

    drafter = a.drafter or (None if a.model else default_drafter_dir())  # the embedded pair has its drafter
    if a.spec != "ar" and drafter is None:
        raise ValueError(f"--spec {a.spec} needs --drafter DIR")
    if a.budget is not None and a.spec != "ddtree":
        raise ValueError(f"--budget applies to --spec ddtree (not {a.spec})")
    spec = SpecConfig(a.spec, (a.budget or 12) if a.spec == "ddtree" else None)
    llm = LLM(
        a.model or default_model_dir(),
        drafter=drafter if a.spec != "ar" else None,
        device=a.device,
        progress=False,
    )
    sp = SamplingParams(max_tokens=a.max_tokens, stop_token_ids=[])
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), spec)  # capture / warm up outside the trace
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        llm.generate([PROFILE_PROMPT], sp, spec)
    prof.export_chrome_trace(a.out)
    sort = "self_cuda_time_total" if llm.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=20)
