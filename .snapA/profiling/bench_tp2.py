"""Two-GPU tensor-parallel check and collective latency (torchrun --nproc-per-node 2).

    torchrun --nproc-per-node 2 profiling/bench_tp2.py --out FILE.md

1. In-graph latency per operation for 7168 x N bf16 (N = 1..256), 20 per graph: NCCL all-reduce alone
   and with the residual add + RMSNorm, torch symmetric memory one-/two-shot + norm, and the fused
   all-reduce + add + RMSNorm (k26/ops/allreduce_group.py: auto, forced one-shot, forced two-shot).
2. The embedded pair at TP 2 (bf16): greedy tokens with graphs == without graphs, DDTree == AR, and the
   batch-1 graph step time; then `python profiling/bench_tp2.py --tp1 FILE.md.json --out FILE.md` runs TP 1
   on one GPU and appends tokens TP 2 == TP 1 and the step times side by side. The pair runs twice: with
   the fused op (the default on NCCL) and with LLM(allreduce="nccl") (NCCL + add + RMSNorm): step times
   and whether the tokens agree.
Exits with os._exit once results are written: NCCL teardown after graph capture can hang (gpu-targets.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from timing import graph_time

DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def run_pair(
    device: str, tp: int, dtype: torch.dtype = torch.bfloat16, allreduce: str = "fused"
) -> tuple[dict, dict]:
    """Greedy tokens (graphs and eager, AR and DDTree) and batch-1 graph step times of the embedded pair."""
    from k26 import LLM, SamplingParams, SpecConfig

    sp = SamplingParams(max_tokens=48, stop_token_ids=[])
    res, times = {}, {}
    # fp32 runs eager only: the int4 MoE kernel takes bf16 activations, and its fp32 reference is not
    # capturable
    for graphs in (True, False) if dtype == torch.bfloat16 else (False,):
        llm = LLM(
            device=device,
            tp=tp,
            dtype=dtype,
            graphs=graphs,
            progress=False,
            max_batch=2,
            max_model_len=512,
            allreduce=allreduce,
        )
        for spec in (SpecConfig("ar"), SpecConfig("ddtree", 8)):
            res[f"{'graphs' if graphs else 'eager'} {spec.method}"] = [
                o.token_ids for o in llm.generate(PROMPTS, sp, spec)
            ]
            if graphs:  # batch 1, after the batch-2 run captured and warmed the buckets
                llm.generate(PROMPTS[:1], sp, spec)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = llm.generate(PROMPTS[:1], sp, spec)[0]
                torch.cuda.synchronize()
                times[f"{spec.method} step"] = (time.perf_counter() - t0) / len(out.stats.accepted_per_step)
        if (
            tp == 1
        ):  # at TP 2 the group is the benchmark's (made before the all-reduce part): it outlives the LLMs
            llm.close()
    return res, times


def collective_table(dev: torch.device, sizes=(1, 8, 16, 64, 256), ops_per_graph: int = 20) -> list[str]:
    """In-graph µs per operation for 7168 x N bf16: NCCL alone and with add + RMSNorm, torch symmetric
    memory one-shot / two-shot (+ norm), and the fused op (auto, forced one-shot, forced two-shot, one-shot
    launched without programmatic dependent launch)."""
    from k26.ops import pdl
    from k26.ops.allreduce_group import FusedAllReduce
    from k26.ops.reference import rms_norm

    group = dist.group.WORLD
    fused = {
        "fused (auto)": FusedAllReduce(group, dev, timeout_s=60),
        "fused one-shot": FusedAllReduce(group, dev, timeout_s=60, two_shot_bytes=1 << 40, max_bytes=4 << 20),
        "fused two-shot": FusedAllReduce(group, dev, timeout_s=60, two_shot_bytes=0, max_bytes=4 << 20),
    }
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group.group_name)
    except Exception as e:  # noqa: BLE001  (a torch without it: the rows say why)
        symm_mem, symm_why = None, f"{type(e).__name__}: {e}"
    w = torch.randn(7168, device=dev, dtype=torch.bfloat16)
    rows = {}
    for N in sizes:
        x = torch.randn(N, 7168, device=dev, dtype=torch.bfloat16)
        r = torch.randn(N, 7168, device=dev, dtype=torch.bfloat16)

        def nccl(x=x):
            dist.all_reduce(x)

        def nccl_norm(x=x, r=r):
            dist.all_reduce(x)
            h = r + x
            return rms_norm(h, w, 1e-6), h

        bodies = {"NCCL": nccl, "NCCL + norm": nccl_norm}
        if symm_mem is not None:
            sx = symm_mem.empty(N, 7168, dtype=torch.bfloat16, device=dev).copy_(x)
            symm_mem.rendezvous(sx, group.group_name)
            bodies["symm one-shot + norm"] = lambda sx=sx, r=r: rms_norm(
                r + torch.ops.symm_mem.one_shot_all_reduce(sx, "sum", group.group_name), w, 1e-6
            )
            bodies["symm two-shot + norm"] = lambda sx=sx, r=r: rms_norm(
                r + torch.ops.symm_mem.two_shot_all_reduce_(sx, "sum", group.group_name), w, 1e-6
            )
        for name, f in fused.items():
            bodies[name] = lambda f=f, x=x, r=r: f(x, r, w, 1e-6)

        def one_shot_no_pdl(f=fused["fused one-shot"], x=x, r=r):  # the launch attribute is read at capture
            with pdl.disabled():
                return f(x, r, w, 1e-6)

        bodies["fused one-shot, no PDL"] = one_shot_no_pdl
        for name, body in bodies.items():
            try:
                us = graph_time(lambda body=body: [body() for _ in range(ops_per_graph)], ops_per_graph) * 1e6
                rows.setdefault(name, {})[N] = f"{us:.1f}"
            except Exception as e:  # noqa: BLE001  (one failing method must not hide the others)
                rows.setdefault(name, {})[N] = f"failed ({type(e).__name__})"
        for f in fused.values():
            f.check()
    cal = fused["fused (auto)"]
    try:
        table = cal.calibrate(rows=sizes)
    except Exception as e:  # noqa: BLE001  (the latency table above must still come out)
        table = f"failed: {type(e).__name__}: {e}"
    print(
        f"calibrate (µs one-shot / two-shot / NCCL + norm): {table}; two-shot from {cal.two_shot_bytes} B, "
        f"NCCL above {cal.nccl_bytes} B",
        flush=True,
    )
    if symm_mem is None:
        rows["symm one-shot / two-shot"] = dict.fromkeys(sizes, f"n/a ({symm_why[:40]})")
    head = "| method | " + " | ".join(f"N = {N} ({N * 14} KiB)" for N in sizes) + " |"
    out = [head, "|---" * (len(sizes) + 1) + "|"]
    out += [f"| {k} | " + " | ".join(v[N] for N in sizes) + " |" for k, v in rows.items()]
    return out


def same(res: dict, a: str, b: str) -> str:
    return "n/a (eager only)" if a not in res else str(res[a] == res[b])


def tp1_check(tp2_json: str, out: str | None) -> None:
    """Rank 0's view of TP 1 on one GPU against the TP 2 run's saved tokens and step times."""
    with open(tp2_json) as f:
        saved = json.load(f)
    res, times = run_pair("cuda", tp=1, dtype=DTYPE[saved["dtype"]])
    lines = ["", f"| TP 2 vs TP 1 (same pair, {saved['dtype']}, greedy) | |", "|---|---|"]
    lines += [f"| {k}: tokens TP 2 == TP 1 | {saved['res'][k] == v} |" for k, v in res.items()]
    lines += [
        f"| {k}: ms TP 1 / TP 2 | {v * 1e3:.3f} / {saved['times'][k] * 1e3:.3f} |" for k, v in times.items()
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtype", choices=sorted(DTYPE), default="bf16")
    ap.add_argument("--tp1", metavar="TP2_JSON", help="run TP 1 alone and compare with a TP 2 run's tokens")
    ap.add_argument(
        "--collectives-only",
        action="store_true",
        help="only the latency table (torchrun --nproc-per-node 1: each method's one-GPU floor)",
    )
    a = ap.parse_args()
    if a.tp1:
        return tp1_check(a.tp1, a.out)
    from k26.dist import init_from_env

    rank, world, dev = init_from_env("cuda")
    if a.collectives_only:
        if world == 1 and not dist.is_initialized():
            dist.init_process_group("nccl", device_id=dev, store=dist.HashStore(), rank=0, world_size=1)
        text = "\n".join(collective_table(dev)) + "\n"
        print(f"{world} x {torch.cuda.get_device_name()}\n{text}", flush=True)
        sys.stdout.flush()
        os._exit(0)
    lines = [
        f"# bench_tp2 — {datetime.date.today()}",
        "",
        f"- device: {world} x {torch.cuda.get_device_name()}; commit {os.environ.get('K26_COMMIT', '?')}",
        "- command: `torchrun --nproc-per-node 2 profiling/bench_tp2.py`",
        "- in-graph, 20 back-to-back operations per graph, µs per operation; + norm: the residual add and",
        "  RMSNorm after the all-reduce (separate kernels except in the fused op)",
        "",
        *collective_table(dev),
    ]
    fused_ms = {}
    for how in ("fused", "nccl"):  # the pair with the fused op (the default on NCCL), then NCCL + add + norm
        fused_ms[how] = run_pair(str(dev), tp=2, dtype=DTYPE[a.dtype], allreduce=how)
    res, times = fused_ms["fused"]
    if rank == 0:
        lines += [
            "",
            f"| TP 2, embedded pair ({a.dtype}), greedy | tokens equal |",
            "|---|---|",
            f"| AR graphs == AR eager | {same(res, 'graphs ar', 'eager ar')} |",
            f"| DDTree graphs == DDTree eager | {same(res, 'graphs ddtree', 'eager ddtree')} |",
            f"| DDTree eager == AR eager (lossless) | {res['eager ddtree'] == res['eager ar']} |",
            "",
            "| TP 2 graphs, batch 1 | ms / step |",
            "|---|---|",
        ]
        lines += [f"| {k} | {v * 1e3:.3f} |" for k, v in times.items()]
        nccl_res, nccl_times = fused_ms["nccl"]
        lines += ["", "| TP 2 graphs, batch 1, greedy | fused ms / step | NCCL ms / step | same tokens |"]
        lines += ["|---|---|---|---|"]
        lines += [
            f"| {k} | {v * 1e3:.3f} | {nccl_times[k] * 1e3:.3f} | "
            f"{res.get('graphs ' + k.split()[0]) == nccl_res.get('graphs ' + k.split()[0])} |"
            for k, v in times.items()
        ]
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if a.out:  # closed here, before os._exit below (which skips Python's cleanup)
            with open(a.out, "w") as f:
                f.write(text)
            with open(a.out + ".json", "w") as f:
                json.dump({"res": res, "times": times, "dtype": a.dtype}, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
