"""Benchmark `torch.ops.k26.drafter_attention` (csrc/drafter_attn.cu) against the drafter's former
composition (the op's reference: gather, concatenate, repeat, fp32 einsum softmax) and the roofline, with
the ceilings measured in the same run (profiling/timing.py).

    python profiling/bench_drafter_attn.py [--out FILE.md] [--quick] [--tune]

Shapes: Kimi-K2.5/K2.6 DFlash (block 8, head_dim 128) at one TP 8 rank (8 query heads over 1 KV head) and
at TP 1 (64 over 8), batch 1. Per shape: graph replay, cold L2 (256 MB read before every replay), median;
small shapes capture several calls on distinct caches in one graph and report per call. Bytes = the live
context K and V read once + q + block K/V + out; FLOPs = 4 x head_dim per (query row, visible key);
roofline = max(bytes / copy BW, FLOPs / mma.sync peak). `--tune`: the minimum keys per split swept.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import copy_bandwidth, graph_time_cold, mma_sync_peak, source_commit

from k26.ops import drafter_attn_cuda, reference

S, HD = 8, 128
SHAPES = {"tp8": (8, 1), "tp1": (64, 8)}  # (query heads, KV heads) per rank


def inputs(Hq, Hkv, L, gen):
    ck = torch.randn(1, L + 1, Hkv, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    cv = torch.randn(1, L + 1, Hkv, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(1, S, Hq, HD, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.3
    kb = torch.randn(1, S, Hkv, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    vb = torch.randn(1, S, Hkv, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows, lens = torch.zeros(1, dtype=torch.long, device="cuda"), torch.full((1,), L, device="cuda")
    return q, ck, cv, kb, vb, rows, lens


def measure(Hq, Hkv, L, gen, fn) -> tuple[float, float, float]:
    """(seconds per call, bytes, flops) of fn(*args, scale) on fresh random inputs."""
    kv_bytes = 2 * (L + S) * Hkv * HD * 2
    copies = max(1, min(16, math.ceil((64 << 20) / kv_bytes)))
    sets = [inputs(Hq, Hkv, L, gen) for _ in range(copies)]

    def run():
        for args in sets:
            fn(*args, HD**-0.5)

    t = graph_time_cold(run, calls=copies)
    return t, kv_bytes + 2 * S * Hq * HD * 2, 4 * HD * S * Hq * (L + S)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="TP 8 only, no reference column at 128K")
    ap.add_argument("--tune", action="store_true", help="sweep MIN_SPLIT_KEYS")
    a = ap.parse_args()
    copy_bw, peak = copy_bandwidth(), mma_sync_peak()
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"# bench_drafter_attn — {datetime.date.today()}",
        "",
        f"- device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}",
        f"- commit: {source_commit() or 'unknown'}",
        f"- command: `python profiling/bench_drafter_attn.py{' --quick' * a.quick}{' --tune' * a.tune}`",
        (
            f"- ceilings in this run: copy {copy_bw / 1e12:.2f} TB/s (eager, read+write), mma.sync bf16 "
            f"{peak / 1e12:.0f} TFLOP/s"
        ),
        "- timing: CUDA-graph replay, cold L2 (256 MB read before each replay), median of 30",
        "",
        "| shape | L | kernel µs | former µs | speed-up | roofline µs | x roofline | % copy BW | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    op = torch.ops.k26.drafter_attention
    for name, (Hq, Hkv) in SHAPES.items():
        if a.quick and name != "tp8":
            continue
        for L in (1024, 4096, 32768, 131072):
            t, nbytes, flops = measure(Hq, Hkv, L, gen, op)
            skip_ref = a.quick and L > 32768  # the former composition takes ~6 ms a call there
            ref = None if skip_ref else measure(Hq, Hkv, L, gen, reference.drafter_attention)[0]
            former = "| | |" if ref is None else f"| {ref * 1e6:.1f} | {ref / t:.1f}x |"
            roof = max(nbytes / copy_bw, flops / peak)
            lines.append(
                f"| {name} | {L} | {t * 1e6:.1f} {former} {roof * 1e6:.1f} | {t / roof:.1f} | "
                f"{100 * nbytes / t / copy_bw:.0f}% | {flops / t / 1e12:.0f} |"
            )
            print(lines[-1], flush=True)
    if a.tune:
        lines += ["", "| min keys per split | L | µs (tp8) |", "|---|---|---|"]
        for mk in (64, 128, 256, 512):
            drafter_attn_cuda.MIN_SPLIT_KEYS = mk
            for L in (1024, 4096, 32768):
                lines.append(f"| {mk} | {L} | {measure(8, 1, L, gen, op)[0] * 1e6:.1f} |")
                print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
