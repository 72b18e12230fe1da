"""Benchmark the MLA tree-attention op against its roofline and the peers a user would reach for.

    python profiling/bench_tree_attn.py [--out FILE.md] [--quick]

Roofline = max(bytes / copy rate, FLOPs / bf16 GEMM rate), both measured in this run. Bytes = the
latent KV the step must read once (B x (L + N) x 576 x 2) plus q and out; FLOPs = 2 x (576 + 512) per
(query row, visible key). k26 is timed as a CUDA-graph replay (median). Peers on a subset of shapes:
FlexAttention (compiled, the same tree mask as a block mask) and SDPA with a dense boolean mask.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
from bench_moe import copy_bandwidth, events_time, gemm_rate, graph_time  # noqa: E402

from k26.ops import tree_mask_to_words  # noqa: E402
from k26.spec.tree import ancestors_from_parents  # noqa: E402


def random_tree(N: int, gen: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=gen)) for i in range(1, N)]
    return ancestors_from_parents(torch.tensor([parents]))[0]


def setup(B, N, H, L, gen):
    cache = torch.randn(B, L + N, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(B, N, H, 576, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.3
    anc = random_tree(N, torch.Generator().manual_seed(N)).expand(B, N, N)
    words = tree_mask_to_words(anc).cuda()
    rows, prefix = torch.arange(B, device="cuda"), torch.full((B,), L, device="cuda")
    return q, cache, rows, prefix, words, anc


def sdpa_peer(q, cache, anc, L, scale):
    B, N, H, _ = q.shape
    mask = torch.cat([torch.ones(N, L, dtype=torch.bool), anc[0]], dim=1).cuda()
    k = cache[:, : L + N].unsqueeze(1)  # [B, 1, L+N, 576] broadcast over heads
    v = cache[:, : L + N, :512].unsqueeze(1)
    qh = q.transpose(1, 2)  # [B, H, N, 576]

    def run():
        return torch.nn.functional.scaled_dot_product_attention(
            qh, k.expand(B, H, -1, -1), v.expand(B, H, -1, -1), attn_mask=mask, scale=scale
        )

    return run


def flex_peer(q, cache, anc, L, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, N, H, _ = q.shape
    tree = anc[0].cuda()

    def mod(b, h, qi, kv):
        j = (kv - L).clamp(0, N - 1)
        return (kv < L) | ((kv >= L) & tree[qi, j])

    bm = create_block_mask(mod, B=None, H=None, Q_LEN=N, KV_LEN=L + N, device="cuda")
    fa = torch.compile(flex_attention, dynamic=False)
    k = cache[:, : L + N].unsqueeze(1).expand(B, H, -1, -1)
    v = cache[:, : L + N, :512].unsqueeze(1).expand(B, H, -1, -1)
    qh = q.transpose(1, 2)

    def run():
        return fa(qh, k, v, block_mask=bm, scale=scale)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    copy_bw, flops_rate = copy_bandwidth(), gemm_rate()
    commit = os.environ.get("K26_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    scale = 0.1446796
    Hs, Ls, Ns, Bs = (8, 64), (1024, 4096, 16384, 65536, 131072), (1, 8, 16, 32, 64, 128, 256), (1, 4)
    if a.quick:
        Ls, Ns = (4096, 65536), (1, 16, 64)
    peers = {(8, 4096, 16), (8, 16384, 64), (8, 65536, 64), (64, 16384, 64), (64, 65536, 64), (64, 4096, 16)}
    lines = [
        f"# bench_tree_attn — {datetime.date.today()}", "",
        f"- device: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs), "
        f"torch {torch.__version__}",
        f"- commit: {commit or 'unknown'}",
        f"- command: `python profiling/bench_tree_attn.py{' --quick' if a.quick else ''}`",
        f"- ceilings measured in this run: copy {copy_bw / 1e12:.2f} TB/s (read+write bytes), "
        f"bf16 GEMM {flops_rate / 1e12:.0f} TFLOP/s", "",
        "| H | L | N | B | KV MB | GFLOP | roofline µs | k26 µs | % roofline | FlexAttention µs | SDPA µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for H in Hs:
        for L in Ls:
            for N in Ns:
                for B in Bs:
                    if B * (L + N) * 576 * 2 > 4e9:
                        continue
                    q, cache, rows, prefix, words, anc = setup(B, N, H, L, gen)
                    t = graph_time(lambda: torch.ops.k26.mla_tree_attention(q, cache, rows, prefix, words, scale, 512), 1)
                    visible = anc[0].sum().item() + N * L
                    bytes_ = B * (L + N) * 576 * 2 + q.numel() * 2 + B * N * H * 512 * 2
                    flops = 2 * (576 + 512) * B * H * visible
                    roof = max(bytes_ / (copy_bw / 1.0), flops / flops_rate)
                    t_flex = t_sdpa = float("nan")
                    if B == 1 and (H, L, N) in peers:
                        try:
                            t_sdpa = events_time(sdpa_peer(q, cache, anc, L, scale), reps=5)
                        except Exception as e:  # report, do not hide, a peer that cannot run
                            print(f"sdpa failed: {e}", file=sys.stderr)
                        try:
                            run = flex_peer(q, cache, anc, L, scale)
                            run()
                            t_flex = events_time(run, reps=5)
                        except Exception as e:
                            print(f"flex failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    lines.append(
                        f"| {H} | {L} | {N} | {B} | {B * (L + N) * 576 * 2 / 1e6:.1f} | {flops / 1e9:.2f} | "
                        f"{roof * 1e6:.1f} | {t * 1e6:.1f} | {100 * roof / t:.1f}% | {t_flex * 1e6:.0f} | {t_sdpa * 1e6:.0f} |"
                    )
                    print(lines[-1], flush=True)
                    del q, cache
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
