"""What the engine-level benchmarks (bench_prefix, bench_prefill_budget, bench_serve) share: the model
arguments and the `LLM` they build, a device sync and the device's name for the results header (the results
file write is timing.report, shared with the kernel benches)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k26 import LLM


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model")
    ap.add_argument("--drafter")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])


def make_llm(a: argparse.Namespace, max_batch: int, max_model_len: int) -> LLM:
    """The `LLM` of add_model_args' arguments (the embedded pair without --model), no progress lines."""
    return LLM(
        a.model,
        drafter=a.drafter,
        device=a.device,
        dtype=getattr(torch, a.dtype),
        progress=False,
        max_batch=max_batch,
        max_model_len=max_model_len,
    )


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
