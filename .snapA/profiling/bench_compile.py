"""torch.compile time of the model body against its layer count (issue 22: start-up compiles one body per
graph bucket, and K2.6 has 61 layers). Each measurement runs in a fresh process (torch's in-memory caches
would otherwise serve the second one), with inductor's on-disk cache off, so the time is a first start's.

    python profiling/bench_compile.py --layers 3 12 48 [--device cuda] [--out FILE.md]

Rows: the KimiK2 decode body (batch 2, one token, fullgraph, dynamic=False) with every layer dense (the
reference MoE is not traceable on the CPU: it loops over the experts it routed to) — compiled as one
unrolled body, and per layer as `LLM(compile=True)` compiles it (`CompiledLayers`: each decoder layer under
torch.compile, layers of one kind sharing the compiled code). Both are checked against the eager forward.
(`torch.compiler.nested_compile_region` on the layer's forward was measured too: no change in a cold
process, profiling/results/2026-12-01-bench_compile-cpu.md.)"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(layers: int, per_layer: bool, device: str) -> dict:
    """Compile and run once in this process; returns seconds and the max abs difference to eager."""
    import time

    import torch

    from k26.config import ModelConfig
    from k26.model import AttnBatch, KimiK2
    from k26.model.model import CompiledLayers
    from k26.tiny import DEFAULT_SIZES, text_config

    sizes = DEFAULT_SIZES | {"num_hidden_layers": layers, "first_k_dense_replace": layers}
    cfg = ModelConfig.from_dict(text_config(sizes, 384, "none"))
    torch.manual_seed(0)
    dev = torch.device(device)
    model = KimiK2(cfg, torch.float32).to(dev).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    ids = torch.randint(0, 300, (2, 1), device=dev)
    cache = torch.randn(layers, 2, 32, cfg.latent_dim, device=dev)
    batch = AttnBatch.causal(torch.tensor([5, 7], device=dev), 1)
    with torch.no_grad():
        ref = model(ids, batch, cache)[0]
        fwd = CompiledLayers(model) if per_layer else torch.compile(model, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        out = fwd(ids, batch, cache)[0]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
    diff = float((out - ref).abs().max())
    return {"layers": layers, "per_layer": per_layer, "seconds": seconds, "diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[3, 12, 48])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=2, type=int, metavar=("LAYERS", "PER_LAYER"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], bool(a.one[1]), a.device)))
        return
    env = dict(os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    rows = []
    for layers in a.layers:
        for per_layer in (0, 1):
            cmd = [sys.executable, __file__, "--device", a.device, "--one", str(layers), str(per_layer)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, check=False, capture_output=True, text=True, cwd=ROOT)
    layer_list = " ".join(map(str, a.layers))
    lines = [
        f"# bench_compile — {datetime.date.today()}",
        "",
        f"- device: {a.device}; commit: {commit.stdout.strip() or '?'}",
        f"- command: `python profiling/bench_compile.py --layers {layer_list} --device {a.device}`",
        "- seconds: torch.compile (dynamo + inductor, fx-graph cache off) + the first call of the body",
        "",
        "| layers | one body s | per layer (LLM) s | one body s / layer (vs row 1) | max abs diff vs eager |",
        "|---|---|---|---|---|",
    ]
    by = {(r["layers"], r["per_layer"]): r for r in rows}
    first = a.layers[0]
    for layers in a.layers:
        p, n = by[layers, False], by[layers, True]
        slope = (
            (p["seconds"] - by[first, False]["seconds"]) / (layers - first)
            if layers != first
            else float("nan")
        )
        diff = max(p["diff"], n["diff"])
        lines.append(f"| {layers} | {p['seconds']:.1f} | {n['seconds']:.1f} | {slope:.2f} | {diff:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
