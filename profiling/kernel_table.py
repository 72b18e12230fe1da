"""Per-kernel table of one graph-replayed K2.6 step (profiling/bench_k26.py `--table-nodes`).

The CUDA-graph replay is recorded with torch.profiler (CUPTI's kernel list: kernels inside a graph are
reported one by one); the chrome trace gives each kernel's name, grid and duration. A decoder layer is cut
out of the kernel sequence between two consecutive MLA attention kernels (one per layer): the segment from
layer i's attention to layer i + 1's holds layer i's second half and layer i + 1's first half, and for
i >= 1 both are MoE layers. Each position of that segment is one row: median µs over the 59 segments.
A kernel launched with programmatic dependent launch starts before its predecessor ends and waits inside
(its weight prefetch overlaps that tail), so its span includes part of the previous kernel's: per-kernel µs
then overlap and their sum can exceed the step. The "path" column is what a kernel adds to the step: its end
minus the latest end before it (0 for a kernel that ends inside a predecessor; idle gaps go to the kernel
after them), so a layer's path times add up to its share of the replay, PDL or not.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections import Counter

import torch

from k26.model import AttnBatch
from k26.model.layers import use_linear_kernel
from k26.model.mla import MLA

ATTN = "tree_attn"
CATEGORIES = (  # first match wins; lower-case substrings of the kernel name (Triton's name the ops they fuse)
    ("fused elementwise (Triton)", ("triton",)),
    ("MLA glue (norms + RoPE + cache write)", ("mla_glue",)),
    ("fused all-reduce + add + RMSNorm (k26)", ("allreduce_add_rmsnorm",)),
    ("residual add + RMSNorm (k26)", ("add_rmsnorm",)),
    ("dense projection (k26 small-M linear)", ("linear_smallm", "linear_tile", "linear_swiglu")),
    ("vocabulary top-k (k26)", ("topk_chunk", "topk_merge")),
    ("drafter attention (k26)", ("split_kernel<", "merge_kernel<")),  # csrc/drafter_attn.cu
    ("MLA tree attention", (ATTN,)),
    ("MLA W_UV + split merge (k26)", ("merge_uv",)),  # csrc/mla_merge_uv.cuh
    ("MoE router", ("router",)),
    ("MoE experts (int4 kernel)", ("moe", "route_kernel", "combine", "gemm_kernel")),
    ("dense projection (cuBLAS)", ("gemv", "gemm", "nvjet", "cutlass", "xmma", "splitk", "sm90_")),
)


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other (ATen)")


def short(name: str, n: int = 70) -> str:
    name = name.replace("(anonymous namespace)::", "").replace("void ", "")
    return name if len(name) <= n else name[: n - 1] + "…"


def record(replay) -> list[dict]:
    """Kernel events of one call of `replay` (a graph replay), in launch order: name, grid, dur µs."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    evs = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    evs.sort(key=lambda e: e["ts"])
    spans = [(float(e["ts"]), float(e["dur"])) for e in evs]
    return [
        {"name": e["name"], "grid": tuple(e.get("args", {}).get("grid", ())), "dur": dur, "ts": ts, "path": p}
        for e, (ts, dur), p in zip(evs, spans, paths(spans), strict=True)
    ]


def paths(spans: list[tuple[float, float]]) -> list[float]:
    """Each kernel's share of the replay's path, from (start, duration) in start order: its end minus the
    latest end before it (0 when it ends inside a predecessor; an idle gap counts to the kernel after it).
    They add up to the last end minus the first start."""
    out, prev_end = [], None
    for ts, dur in spans:
        out.append(dur if prev_end is None else max(ts + dur - prev_end, 0.0))
        prev_end = ts + dur if prev_end is None else max(prev_end, ts + dur)
    return out


def _summed(kernels: list[dict]) -> dict[str, list[float]]:
    """Per kernel name: [launches, summed µs, summed path µs] (path: 0 where the events carry none)."""
    agg: dict[str, list[float]] = {}
    for k in kernels:
        a = agg.setdefault(k["name"], [0, 0.0, 0.0])
        a[0], a[1], a[2] = a[0] + 1, a[1] + k["dur"], a[2] + k.get("path", 0.0)
    return agg


def by_name(kernels: list[dict], label: str, top: int = 25) -> list[str]:
    """Markdown: one replay's kernels summed by name, the most time first (launches, µs, share of the sum).
    For steps that are not a chain of identical layers (a whole speculative step, the drafter)."""
    total = sum(k["dur"] for k in kernels) or 1.0
    out = ["", f"### {label}: {len(kernels)} kernels, summed {total / 1e3:.2f} ms", ""]
    out += ["| kernel | category | launches | µs | share |", "|---|---|---|---|---|"]
    for name, (n, dur, _) in sorted(_summed(kernels).items(), key=lambda kv: -kv[1][1])[:top]:
        out.append(f"| `{short(name)}` | {category(name)} | {n} | {dur:.0f} | {100 * dur / total:.1f}% |")
    return out


def spec_phases(kernels: list[dict]) -> list[str]:
    """Markdown: a whole speculative step's replay cut into draft (+ tree build), verify and accept (+ KV
    commit + drafter context) at landmark kernels: the verify runs from the kernel before layer 0's MLA
    glue (its q_a / kv_a projection) to two kernels past the last residual add + norm (the final norm, then
    the head's GEMM and argmax). Span: first kernel's start to last kernel's end (PDL overlap included)."""
    glue = [i for i, k in enumerate(kernels) if "mla_glue" in k["name"]]
    norms = [i for i, k in enumerate(kernels) if "add_rmsnorm" in k["name"]]
    if not glue or not norms:
        return ["- no phase landmarks (MLA glue / add_rmsnorm kernels) in the trace"]
    a, b = max(glue[0] - 1, 0), min(norms[-1] + 2, len(kernels) - 1)
    out = ["", "| phase | kernels | span µs | summed µs |", "|---|---|---|---|"]
    cuts = (("draft + tree", 0, a), ("verify", a, b + 1), ("accept + commit + context", b + 1, len(kernels)))
    for name, lo, hi in cuts:
        ks = kernels[lo:hi]
        if not ks:
            continue
        span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
        out.append(f"| {name} | {len(ks)} | {span:.0f} | {sum(k['dur'] for k in ks):.0f} |")
    for name, lo, hi in (cuts[0], cuts[2]):  # the verify is the layer table's; these are the step's own
        if hi > lo:
            out += phase_path(kernels[lo:hi], name)
    return out


def phase_path(kernels: list[dict], label: str, top: int = 15) -> list[str]:
    """Markdown: one phase's kernels by name, the most time on the replay's path first (launches, summed µs,
    path µs: what removing them would save at most)."""
    out = ["", f"{label}, by path:", "", "| kernel | category | launches | µs | path µs |"]
    out.append("|---|---|---|---|---|")
    for name, (n, dur, path) in sorted(_summed(kernels).items(), key=lambda kv: -kv[1][2])[:top]:
        out.append(f"| `{short(name)}` | {category(name)} | {n} | {dur:.0f} | {path:.0f} |")
    return out


def layer_segments(kernels: list[dict]) -> list[list[dict]]:
    """The kernel runs between consecutive attention kernels, from the second on (MoE layers only), keeping
    the runs with the most common name sequence."""
    at = [i for i, k in enumerate(kernels) if ATTN in k["name"]]
    segs = [kernels[at[i] : at[i + 1]] for i in range(1, len(at) - 1)]
    if not segs:
        return []
    sig = Counter(tuple(k["name"] for k in s) for s in segs).most_common(1)[0][0]
    return [s for s in segs if tuple(k["name"] for k in s) == sig]


def table(
    kernels: list[dict], step_s: float, layers: int, layer_bytes: dict[str, float], copy_bw: float, label: str
) -> list[str]:
    """Markdown: the step's totals, one MoE layer's kernels in order, and its time by category with bytes
    and % of copy bandwidth where the bytes are known (`layer_bytes`: category -> bytes per layer)."""
    total_us = sum(k["dur"] for k in kernels)
    segs = layer_segments(kernels)
    out = [
        "",
        f"### {label}",
        "",
        (
            f"- step (graph replay, median): {step_s * 1e3:.2f} ms; kernels in the step: {len(kernels)} "
            f"({len(kernels) / layers:.1f} per layer over {layers} layers); summed kernel time "
            f"{total_us / 1e3:.2f} ms"
        ),
    ]
    if not segs:
        return out + ["- no layer segments found (attention kernel not in the trace)"]
    n = len(segs[0])
    med = [statistics.median(s[j]["dur"] for s in segs) for j in range(n)]
    path = [statistics.median(s[j]["path"] for s in segs) for j in range(n)]
    out += [
        (
            f"- one MoE layer (median of {len(segs)} segments between attention kernels): **{n} kernels**, "
            f"{sum(med):.1f} µs summed, {sum(path):.1f} µs on the step's path"
        ),
        "",
        "| # | kernel | grid | category | µs | path µs |",
        "|---|---|---|---|---|---|",
    ]
    for j, k in enumerate(segs[0]):
        grid = "x".join(map(str, k["grid"]))
        name = f"`{short(k['name'])}` | {grid} | {category(k['name'])}"
        out.append(f"| {j + 1} | {name} | {med[j]:.1f} | {path[j]:.1f} |")
    by_cat: dict[str, list[tuple[float, float]]] = {}
    for j, k in enumerate(segs[0]):
        by_cat.setdefault(category(k["name"]), []).append((med[j], path[j]))
    out += [
        "",
        "| category | launches per layer | µs per layer | MB per layer | % copy BW | path µs per layer |",
        "|---|---|---|---|---|---|",
    ]
    for c, ts in sorted(by_cat.items(), key=lambda kv: -sum(t for t, _ in kv[1])):
        out.append(
            row(c, len(ts), sum(t for t, _ in ts), layer_bytes.get(c, 0), copy_bw, sum(p for _, p in ts))
        )
    # The dense bytes include q_b's, which one token's fused path runs inside the glue kernel: its time then
    # counts here too (the row's label says so), not only under the glue's category.
    dense = [
        (med[j], path[j])
        for j, k in enumerate(segs[0])
        if category(k["name"]).startswith("dense projection") or "glue_linear" in k["name"]
    ]
    out.append(
        row(
            "all dense projections of the layer (q_b's glue + linear kernel included where it runs)",
            len(dense),
            sum(t for t, _ in dense),
            layer_bytes["dense"],
            copy_bw,
            sum(p for _, p in dense),
        )
    )
    return out


def row(what: str, launches: int, us: float, nbytes: float, copy_bw: float, path_us: float) -> str:
    bw = f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}%" if nbytes and us else ""
    mb = f"{nbytes / 1e6:.1f}" if nbytes else ""
    return f"| {what} | {launches} | {us:.1f} | {mb} | {bw} | {path_us:.1f} |"


VARIANTS = ("base", "glue", "fused", "fused-all")  # bench_k26 --variants (its docstring)


def apply_variant(model, name: str) -> None:
    """Switch the dense path to variant `name` (base / glue before fused*: `fuse_` stacks the weights for
    good); the fused variants switch among themselves in any order."""
    if name not in VARIANTS:
        raise ValueError(f"unknown dense-path variant {name!r}: one of {', '.join(VARIANTS)}")
    attns = [m for m in model.modules() if isinstance(m, MLA)]
    if name in ("base", "glue") and any(m.qkv_a is not None for m in attns):
        raise ValueError(f"dense-path variant {name!r} after a fused one: fuse_ stacked the weights for good")
    fused = name in ("fused", "fused-all")
    for m in attns:
        m.glue = name != "base"
        if fused:
            m.fuse_(kernel_max_m=64)
    use_linear_kernel(model, name == "fused-all")
    if fused:
        model.fuse_mlp_()  # as fuse_dense_: the dense layers' MLP in the small-M kernel (SiLU·up fused)
    for norm in model.residual_norms():  # the residual add + norm as one op (csrc/add_rmsnorm.cu)
        norm.use_kernel = fused


def experts_touched(verify, counter) -> float:
    """Mean experts per MoE layer that one eager pass of `verify` touches (`counter`: the list the counting
    hook appends to and its on switch; the hook syncs with the host, so the pass is never traced)."""
    touched, counting = counter
    touched.clear()
    counting[0] = True
    try:
        with torch.compiler.set_stance("force_eager"):
            verify()
    finally:
        counting[0] = False
    return statistics.mean(touched) if touched else 0


def step_gb(nonrouted: int, routed: float, kv_bytes: int, N: int, cfg) -> float:
    """GB one step must read: the non-routed parameters (the embedding table left out: `param_bytes`), the
    touched experts, the latent KV of the prefix, and the N embedding rows the step gathers."""
    return (nonrouted + routed + kv_bytes + N * cfg.hidden_size * 2) / 1e9


def param_bytes(model, routed: bool) -> int:
    """Bytes of the routed int4 experts (routed) or of every other parameter but the embedding table, of
    which a step reads only its tokens' rows (counted by `step_gb`)."""
    from k26.model.layers import VocabEmbedding
    from k26.model.moe import Int4Experts

    tot = 0
    for m in model.modules():
        if isinstance(m, VocabEmbedding):
            continue
        own = sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        if isinstance(m, Int4Experts) == routed:
            tot += own
    return tot


def run_variants(model, cfg, a, L, nodes, counter, sizes, graph_step_time) -> list[str]:
    """Step time of each variant at each N, and its per-kernel table at --table-nodes."""
    nonrouted, per_expert, copy_bw = sizes
    dev = torch.device("cuda")
    table_nodes = {int(x) for x in a.table_nodes.split(",") if x}
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    layer = model.layers[min(1, len(model.layers) - 1)]
    nbytes = lambda mod: sum(p.numel() * p.element_size() for p in mod.parameters())
    cache = torch.zeros(cfg.num_hidden_layers, 1, L + 512, cfg.latent_dim, dtype=torch.bfloat16, device=dev)
    rows, start = torch.zeros(1, dtype=torch.long, device=dev), torch.full((1,), L, device=dev)
    kv_bytes = cfg.num_hidden_layers * L * cfg.latent_dim * 2
    rows_out, tables = [], []
    for name in a.variants.split(","):
        apply_variant(model, name)
        for N in nodes:
            gen = torch.Generator(device=dev).manual_seed(N)  # the same tokens (and experts) in every variant
            ids = torch.randint(0, cfg.vocab_size, (1, N), device=dev, generator=gen)
            batch = AttnBatch.tree(
                start, torch.ones(N, N, dtype=torch.bool, device=dev).tril()[None], rows, static=True
            )

            def verify(ids=ids, batch=batch):
                h, _ = model(ids, batch, cache)
                model.logits(h)

            experts = experts_touched(verify, counter)
            kernels: list | None = [] if N in table_nodes else None
            t = graph_step_time(verify, lambda: None, kernels)
            gb = step_gb(nonrouted, experts * per_expert * moe_layers, kv_bytes, N, cfg)
            rows_out.append(
                f"| {name} | {L} | {N} | {t * 1e3:.2f} | {experts:.0f} | {gb:.2f} | {gb / t:.0f} | "
                f"{100 * gb * 1e9 / t / copy_bw:.0f}% |"
            )
            print(rows_out[-1], flush=True)
            if kernels is not None:
                layer_bytes = {
                    "dense": nbytes(layer.self_attn),
                    "MoE router": nbytes(layer.mlp.gate),
                    "MoE experts (int4 kernel)": experts * per_expert + nbytes(layer.mlp.shared_experts),
                    "MLA tree attention": L * cfg.latent_dim * 2,
                }
                tables += table(
                    kernels, t, cfg.num_hidden_layers, layer_bytes, copy_bw, f"{name}, L = {L}, N = {N}"
                )
                print("\n".join(tables[-60:]), flush=True)
    return rows_out + tables
