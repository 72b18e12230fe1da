"""The draft's vocabulary top-k (VocabHead.topk_logprobs: logsumexp + topk over this rank's logits) alone in a
CUDA graph: replay µs and the kernels' summed µs (an idle gap inside the replay shows as replay > summed),
torch's topk against a two-stage one (top-k of 1,024-wide chunks, then of their candidates) and against
torch.ops.k26.logits_topk (whose log-sum-exp comes with it: its row also runs the logsumexp, unused); then
the op's kernels alone.

    python profiling/debug/topk_probe.py
"""

import sys
from pathlib import Path

import torch

import k26.ops  # noqa: F401  (registers torch.ops.k26.logits_topk)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_table import record
from timing import capture, graph_time


def chunked_topk(x: torch.Tensor, k: int, w: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, n = x.shape
    c = x.view(*lead, n // w, w).topk(k, dim=-1)
    idx = c.indices + torch.arange(0, n, w, device=x.device)[:, None]
    v, j = c.values.flatten(-2).topk(k, dim=-1)
    return v, idx.flatten(-2).gather(-1, j)


def k26_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.k26.logits_topk(x, k)[:2]


def probe(x: torch.Tensor, k: int, name: str, fn) -> str:
    want = x.topk(k, dim=-1)
    v, i = fn(x, k)
    same = torch.equal(v, want.values) and torch.equal(x.gather(-1, i), want.values)

    def step():
        x.logsumexp(-1)
        fn(x, k)

    t = graph_time(step, 1)
    ks = record(capture(step).replay)
    summed = sum(e["dur"] for e in ks)
    return f"| {x.shape[-1]} | {k} | {name} | {t * 1e6:.1f} | {len(ks)} | {summed:.1f} | {same} |"


def main() -> None:
    torch.manual_seed(0)
    print("| vocab part | k | method | replay µs | kernels | summed µs | same top-k |")
    print("|---|---|---|---|---|---|---|")
    for part in (20480, 163840):
        x = torch.randn(1, 15, part, device="cuda") * 3
        for k in (15, 31, 64):
            print(probe(x, k, "torch.topk", lambda x, k: x.topk(k, dim=-1)), flush=True)
            print(probe(x, k, "chunked", chunked_topk), flush=True)
            print(probe(x, k, "k26.logits_topk", k26_topk), flush=True)
    # The op's own kernels, without the probe's logsumexp: an A/B of kernel variants reads these rows.
    print("\n| vocab part | k | kernel | µs |\n|---|---|---|---|")
    for part in (20480, 163840):
        x = torch.randn(1, 15, part, device="cuda") * 3
        for k in (15, 64):
            graph = capture(lambda x=x, k=k: torch.ops.k26.logits_topk(x, k))
            for _ in range(3):  # warm: the recorded replay is the fourth
                graph.replay()
            for e in record(graph.replay):
                print(f"| {part} | {k} | {e['name'][:40]} | {e['dur']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
