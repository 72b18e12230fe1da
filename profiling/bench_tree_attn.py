"""Benchmark `torch.ops.k26.mla_tree_attention` against its roofline, with the ceilings measured in the
same run (profiling/timing.py): eager copy bandwidth, the mma.sync bf16 peak, cuBLAS's bf16 GEMM rate.

    python profiling/bench_tree_attn.py [--out FILE.md] [--quick] [--tune] [--rotary] [--uv]

Per shape: graph replay, cold L2 (256 MB read before every replay), median; small shapes capture
several calls on distinct inputs in one graph and report per call (the graph launch is amortised, every
call still reads its KV from HBM). Bytes = the latent KV read once (B x (L + N) x 576 x 2) + q + out;
FLOPs = 2 x (576 + 512) per (query row, visible key). roofline = max(bytes / copy BW, FLOPs / mma.sync
peak); "x roofline" = time / roofline. `--tune` sweeps the minimum keys per split. `--rotary`: the query as
the model passes it, q̃ [.., 512] and q_pe before RoPE (a strided view of a q_b-like output), rotated in the
kernel. `--uv`: the attention followed by W_UV at decode and verify-tree shapes, as two ops
(mla_tree_attention + linear_grouped) and as `mla_tree_attention_uv` (W_UV's kernel merging the splits).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import copy_bandwidth, gemm_rate, graph_time_cold, mma_sync_peak, source_commit

from k26.ops import attention_cuda, tree_mask_to_words
from k26.spec.tree import ancestors_from_parents

SCALE = 0.1446796


def random_tree(N: int, gen: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=gen)) for i in range(1, N)]
    return ancestors_from_parents(torch.tensor([parents]))[0]


def inputs(B, N, H, L, gen, rotary=False):
    """The op's positional arguments up to mask_words, the trailing ones (rotary query), the ancestors."""
    cache = torch.randn(B, L + N, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(B, N, H, 576, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.3
    anc = random_tree(N, torch.Generator().manual_seed(N)).expand(B, N, N)
    words = tree_mask_to_words(anc).cuda()
    rows, prefix = torch.arange(B, device="cuda"), torch.full((B,), L, device="cuda")
    if not rotary:
        return (q, cache, rows, prefix, words), (), anc
    q_b = torch.randn(B, N, H, 192, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.3
    positions = prefix[:, None] + torch.arange(N, device="cuda")
    inv_freq = 1.0 / (50000.0 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    return (
        (q[..., :512].contiguous(), cache, rows, prefix, words),
        (False, q_b[..., 128:], positions, inv_freq),
        anc,
    )


def measure(B, N, H, L, gen, rotary=False) -> tuple[float, float, float]:
    """(seconds per call, bytes, flops) on fresh random inputs."""
    kv_bytes = B * (L + N) * 576 * 2
    copies = max(1, min(16, math.ceil((64 << 20) / kv_bytes)))  # distinct inputs per graph for small shapes
    sets = [inputs(B, N, H, L, gen, rotary) for _ in range(copies)]

    def run():
        for args, extra, _ in sets:
            torch.ops.k26.mla_tree_attention(*args, SCALE, 512, *extra)

    t = graph_time_cold(run, calls=copies)
    anc = sets[0][2]
    visible = anc[0].sum().item() + N * L
    bytes_ = kv_bytes + B * N * H * (576 + 512) * 2
    return t, bytes_, 2 * (576 + 512) * B * H * visible


def measure_uv(H, N, L, gen) -> tuple[float, float]:
    """(seconds for attention + W_UV as two ops, seconds as mla_tree_attention_uv) per call, B = 1."""
    copies = max(1, min(16, math.ceil((64 << 20) / ((L + N) * 1152))))
    sets = []
    for _ in range(copies):
        args, extra, _ = inputs(1, N, H, L, gen, rotary=True)
        kv_b = torch.randn(H, 256, 512, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
        sets.append((args, extra, kv_b[:, 128:]))

    def pair():
        for args, extra, w_uv in sets:
            o, _ = torch.ops.k26.mla_tree_attention(*args, SCALE, 512, *extra)
            torch.ops.k26.linear_grouped(o, w_uv)

    def fused():
        for args, extra, w_uv in sets:
            torch.ops.k26.mla_tree_attention_uv(*args, SCALE, w_uv, *extra)

    return graph_time_cold(pair, calls=copies), graph_time_cold(fused, calls=copies)


def uv_table(gen) -> list[str]:
    lines = [
        "| H | N | L | attention + W_UV, two ops µs | mla_tree_attention_uv µs | saved µs |",
        "|---|---|---|---|---|---|",
    ]
    shapes = [(8, 1, L) for L in (1024, 4096, 8191, 8192, 32768, 131072)] + [(16, 1, 4096), (8, 2, 4096)]
    shapes += [(8, 16, 4096), (8, 16, 32768)]  # the TP8 verify tree (its four 32-row tiles deferred too)
    for H, N, L in shapes:
        t2, t1 = measure_uv(H, N, L, gen)
        lines.append(f"| {H} | {N} | {L} | {t2 * 1e6:.1f} | {t1 * 1e6:.1f} | {(t2 - t1) * 1e6:.1f} |")
        print(lines[-1], flush=True)
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true", help="sweep MIN_SPLIT_KEYS on a few shapes")
    ap.add_argument("--rotary", action="store_true", help="q̃ and q_pe apart, RoPE in the kernel")
    ap.add_argument("--shapes", default=None, help="H:N:L:B,... instead of the default shapes")
    ap.add_argument("--uv", action="store_true", help="only the attention + W_UV table")
    a = ap.parse_args()
    copy_bw, mma_peak, gemm = copy_bandwidth(), mma_sync_peak(), gemm_rate()
    commit = source_commit()
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"# bench_tree_attn — {datetime.date.today()}",
        "",
        f"- device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}",
        f"- commit: {commit or 'unknown'}",
        f"- command: `python profiling/bench_tree_attn.py {' '.join(sys.argv[1:])}`",  # as run, every flag
        (
            f"- ceilings in this run: copy {copy_bw / 1e12:.2f} TB/s (eager, read+write), mma.sync bf16 "
            f"{mma_peak / 1e12:.0f} TFLOP/s, cuBLAS bf16 GEMM {gemm / 1e12:.0f} TFLOP/s"
        ),
        "- timing: CUDA-graph replay, cold L2 (256 MB read before each replay), median of 30",
        "",
    ]
    gen = torch.Generator(device="cuda").manual_seed(0)
    if a.uv:
        lines += uv_table(gen)
        print("\n".join(lines))
        if a.out:
            with open(a.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        return
    if a.tune:
        lines += ["| min keys/split | H | N | L | µs |", "|---|---|---|---|---|"]
        for mk in (32, 64, 128, 256):
            attention_cuda.MIN_SPLIT_KEYS = mk
            for H, N, L in ((8, 1, 1024), (8, 1, 4096), (8, 16, 4096), (8, 1, 32768), (8, 16, 32768)):
                t, _, _ = measure(1, N, H, L, gen)
                lines.append(f"| {mk} | {H} | {N} | {L} | {t * 1e6:.1f} |")
                print(lines[-1], flush=True)
        attention_cuda.MIN_SPLIT_KEYS = 64
        lines.append("")
    shapes = [(8, N, L, 1) for L in (1024, 4096, 32768, 131072) for N in (1, 2, 16, 64)]
    shapes += [(64, 1, 4096, 1), (64, 1, 32768, 1), (64, 16, 32768, 1), (8, 16, 4096, 4), (8, 1, 32768, 4)]
    if a.shapes:
        shapes = [tuple(int(v) for v in item.split(":")) for item in a.shapes.split(",")]
    elif a.quick:
        shapes = [
            (8, 1, 4096, 1),
            (8, 16, 4096, 1),
            (8, 1, 32768, 1),
            (8, 1, 131072, 1),
            (8, 16, 32768, 1),
            (8, 64, 32768, 1),
        ]
    lines += [
        "| H | N | L | B | KV MB | GFLOP | roofline µs | k26 µs | % copy BW | TFLOP/s | % mma | x roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for H, N, L, B in shapes:
        t, bytes_, flops = measure(B, N, H, L, gen, a.rotary)
        roof = max(bytes_ / copy_bw, flops / mma_peak)
        lines.append(
            f"| {H} | {N} | {L} | {B} | {B * (L + N) * 1152 / 1e6:.1f} | {flops / 1e9:.2f} | "
            f"{roof * 1e6:.1f} | "
            f"{t * 1e6:.1f} | {100 * bytes_ / t / copy_bw:.0f}% | {flops / t / 1e12:.0f} | "
            f"{100 * flops / t / mma_peak:.0f}% | {t / roof:.2f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
