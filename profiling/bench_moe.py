"""Benchmark the fused INT4 MoE op against the copy-bandwidth ceiling and the peers a user would reach for.

    python profiling/bench_moe.py [--out FILE.md] [--shapes tp8,tp1] [--ms 1,2,4,...]

For each shape (K2.6 at one TP8 rank: E 384, D 7168, I 256, top-8; and at TP1: I 2048), batch M and
routing (uniform; skewed = Zipf(1.2) expert popularity):
  - k26: `torch.ops.k26.moe_w4a16_repacked` inside a CUDA graph that runs it over L distinct layers in
    a row (so the touched experts never sit in L2 between calls, as in a real forward); time = replay / L,
    median of replays, each after a 256 MB read (cold L2: the first layer's experts too).
  - bf16 grouped_mm: bf16 weights through `torch._grouped_mm` (sort by expert, two grouped GEMMs,
    weighted index_add), also graph-captured; what a user without an int4 kernel would run.
  - reference: the pure-torch op on the checkpoint layout (dequantise touched experts, matmul), eager.
"Weight MB" = int4 + scale bytes of the distinct experts touched (what must cross HBM); GB/s and
"% copy" use it against the device-to-device copy rate measured in the same run (read + write bytes).

    python profiling/bench_moe.py --block [--out FILE.md] [--shapes tp8,tp1] [--ms 1,2,4,8,16,32,64]

The whole MoE block as `k26/model/moe.py` runs it on CUDA (normed hidden in, block output out, before the
all-reduce): fused router kernel -> int4 expert op with the bf16 shared expert in its grids; against the same
with the shared expert as separate GEMMs, and the block before issue 17 (reference router: fp32 copy of the
weight, GEMV, topk; separate shared expert), L distinct layers per graph replay and
the L2 flushed before each replay (cold). Skewed routing: 10 experts get a large correction bias, so every
token picks 8 of those 10. Bytes = router + shared expert + touched routed experts (logical size: int4 +
one bf16 scale per 32); "launches" counts the CUDA kernels of one eager block (torch.profiler).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

import torch
import torch.nn.functional as F

from k26.ops import moe_cuda, reference
from k26.ops.moe_cuda import pick_nt

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_block import SHAPES, block_main, expert_bytes
from timing import copy_bandwidth, events_time, gemm_rate, graph_time_cold, source_commit


def routing(kind: str, M: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.rand(M, E, generator=gen, device="cuda").topk(K, dim=-1).indices
    p = 1.0 / torch.arange(1, E + 1, device="cuda", dtype=torch.float32) ** 1.2
    p = p[torch.randperm(E, generator=gen, device="cuda")]
    return torch.multinomial(p.expand(M, E), K, replacement=False, generator=gen)


def grouped_mm_moe(x, w13_bf, w2_bf, ids, tw):
    """bf16 MoE without a custom kernel: sort pairs by expert, two grouped GEMMs, weighted scatter."""
    M, K = ids.shape
    E = w13_bf.shape[0]
    flat = ids.flatten()
    order = flat.argsort()
    tok = order // K
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[tok], w13_bf.transpose(1, 2), offs=offs)
    inter = h.shape[1] // 2
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w2_bf.transpose(1, 2), offs=offs)
    out = torch.zeros(M, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * tw.flatten()[order, None])
    return out.to(x.dtype)


def bench_shape(name: str, shp: dict, ms: list[int], copy_bw: float, rows: list[str]) -> None:
    E, D, I, K, L = shp["E"], shp["D"], shp["I"], shp["K"], shp["layers"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def words(*s):
        return torch.randint(-(2**31), 2**31 - 1, s, generator=gen, dtype=torch.int32, device="cuda")

    def scales(*s):
        return (torch.rand(*s, generator=gen, device="cuda") * 0.02 + 1e-3).to(torch.bfloat16)

    layers = [
        (
            words(E, I // 8, D // 64, 32, 4),
            scales(E, I // 8, D // 64, 16, 2),
            words(E, D // 16, I // 64, 32, 4),
            scales(E, D // 16, I // 64, 16, 2),
        )
        for _ in range(L)
    ]
    bf_layers = [
        (
            torch.randn(E, 2 * I, D, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02,
            torch.randn(E, D, I, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02,
        )
        for _ in range(max(1, L // 4))
    ]
    ct = (
        words(E, I, D // 8),
        scales(E, I, D // 32),
        words(E, I, D // 8),
        scales(E, I, D // 32),
        words(E, D, I // 8),
        scales(E, D, I // 32),
    )
    for kind in ("uniform", "skewed"):
        for M in ms:
            x = torch.randn(M, D, generator=gen, device="cuda").to(torch.bfloat16)
            ids = routing(kind, M, E, K, gen)
            tw = torch.rand(M, K, generator=gen, device="cuda")
            touched = int(ids.unique().numel())
            mb = touched * expert_bytes(D, I) / 1e6

            def k26_all(x=x, ids=ids, tw=tw):
                for w in layers:
                    torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw)

            t = graph_time_cold(k26_all, L)  # cold L2 before each replay, as every weight-streaming bench

            def bf_all(x=x, ids=ids, tw=tw):
                for w13, w2 in bf_layers:
                    grouped_mm_moe(x, w13, w2, ids, tw)

            try:
                t_bf = graph_time_cold(bf_all, len(bf_layers))
            except Exception as e:  # noqa: BLE001  (report, do not hide, a peer that cannot run)
                print(f"grouped_mm failed at M={M}: {e}", file=sys.stderr)
                t_bf = float("nan")
            t_ref = (
                events_time(lambda x=x, ids=ids, tw=tw: reference.moe_w4a16(x, *ct, ids, tw), reps=3)
                if M in (1, 16, 64)
                else float("nan")
            )
            gbs = mb / 1e3 / t
            finite = [v for v in (t_bf, t_ref) if math.isfinite(v)]
            best_peer = min(finite) if finite else float("nan")
            rows.append(
                f"| {name} | {kind} | {M} | {touched} | {mb:.1f} | {t * 1e6:.1f} | {gbs:.0f} | "
                f"{100 * gbs * 1e9 / copy_bw:.1f}% | {t_bf * 1e6:.1f} | {t_ref * 1e6:.0f} | "
                f"{best_peer / t:.1f}x | "
                f"{pick_nt(M * K, E)} |"
            )
            print(rows[-1], flush=True)
    torch.cuda.empty_cache()


def kernel_breakdown(shp: dict, M: int) -> list[str]:
    """Per-kernel device time of one eager call (torch.profiler), to say what bounds a miss."""
    from torch.profiler import ProfilerActivity, profile

    E, D, I, K = shp["E"], shp["D"], shp["I"], shp["K"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = (
        torch.randint(
            -(2**31), 2**31 - 1, (E, I // 8, D // 64, 32, 4), generator=gen, dtype=torch.int32, device="cuda"
        ),
        torch.rand(E, I // 8, D // 64, 16, 2, generator=gen, device="cuda").to(torch.bfloat16),
        torch.randint(
            -(2**31), 2**31 - 1, (E, D // 16, I // 64, 32, 4), generator=gen, dtype=torch.int32, device="cuda"
        ),
        torch.rand(E, D // 16, I // 64, 16, 2, generator=gen, device="cuda").to(torch.bfloat16),
    )
    x = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    ids = routing("uniform", M, E, K, gen)
    tw = torch.rand(M, K, device="cuda")
    for _ in range(3):
        torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw)
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            out.append(f"| {M} | `{ev.key[:70]}` | {ev.device_time_total / max(ev.count, 1):.1f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--split-down",
        action="store_true",
        help="the MoE down GEMM + combine as two launches where one serves (moe_cuda.split_down)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="tp8,tp1")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument(
        "--block", action="store_true", help="the whole MoE block (router + experts + shared expert)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="--block without the two baselines (shared separate, before)"
    )
    a = ap.parse_args()
    moe_cuda.SPLIT_DOWN = a.split_down  # read at each launch and capture below
    ms = [int(v) for v in a.ms.split(",")]
    copy_bw, flops = copy_bandwidth(), gemm_rate()
    commit = source_commit()
    head = [
        f"# bench_moe — {datetime.date.today()}",
        "",
        (
            f"- device: {torch.cuda.get_device_name()} "
            f"({torch.cuda.get_device_properties(0).multi_processor_count} SMs), "
            f"torch {torch.__version__}"
        ),
        f"- commit: {commit or 'unknown'}",
        (
            f"- command: `python profiling/bench_moe.py{' --block' if a.block else ''}"
            f"{' --quick' if a.quick else ''}{' --split-down' if a.split_down else ''} --shapes {a.shapes} "
            f"--ms {a.ms}`"
        ),
        (
            f"- ceilings measured in this run: copy {copy_bw / 1e12:.2f} TB/s (read+write bytes), "
            f"bf16 GEMM {flops / 1e12:.0f} TFLOP/s"
        ),
    ]
    if a.block:
        text = block_main(a, copy_bw, head)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text)
        return
    head += [
        "",
        (
            "| shape | routing | M | experts touched | weight MB | k26 µs | GB/s | % copy | "
            "bf16 grouped_mm µs | "
            "reference µs | vs best peer | NT |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    rows: list[str] = []
    for name in a.shapes.split(","):
        bench_shape(name, SHAPES[name], ms, copy_bw, rows)
    tail = [
        "",
        "Per-kernel device time, TP8 shape, uniform routing (torch.profiler, eager):",
        "",
        "| M | kernel | µs |",
        "|---|---|---|",
    ]
    for M in (1, 64):
        tail += kernel_breakdown(SHAPES["tp8"], M)
    text = "\n".join(head + rows + tail) + "\n"
    print("\n".join(tail))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
