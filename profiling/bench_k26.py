"""K2.6-scale speed on one GPU: the full 61-layer target at one TP rank's shard shapes (default rank 0 of
TP 8), random weights in the loaded layouts (bf16 + repacked int4 experts), plus a DFlash drafter at
the same rank's shapes, against the byte roofline measured in the same run.

    python profiling/bench_k26.py [--tp 8] [--layers 61] [--ctx 4096,32768] [--nodes 1,8,16,32,64] [--out F]
    python profiling/bench_k26.py --compile --variants base,fused --nodes 1,16 --table-nodes 1,16 --ctx 4096
    (--no-pdl: every k26 kernel launched without programmatic dependent launch, for the on / off comparison;
    --fused: the step rows, speculative steps included, on the loader's inference path, KimiK2.fuse_dense_)

`--variants`: the decode / verify rows of each variant of the dense path in turn (base: the module glue and
cuBLAS; glue: torch.ops.k26.mla_glue; fused: + stacked q_a / kv_a, W_UK, W_UV, o_proj and the dense
layer's MLP (gate / up with SiLU·up: linear_swiglu) in the small-M kernel and the residual adds + norms as
torch.ops.k26.add_rmsnorm; fused-all: + every projection and the head in the
small-M kernel), each with a per-kernel table of the
graph-replayed step at `--table-nodes` (profiling/kernel_table.py).

Collectives are excluded (the TP group is a no-op here; they are measured on two GPUs and modelled for
eight). Every step is a CUDA-graph replay (median). Bytes per step: every non-routed parameter of the
rank once, the routed experts a verify of N tokens touches — counted from the actual routing of the
step's tokens, layer by layer — and the latent KV of the context.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from k26_scale import K26_TEXT, drafter_config, randomize, seed_draft_topk, token_ids
from kernel_table import (
    VARIANTS,
    by_name,
    category,
    experts_touched,
    param_bytes,
    record,
    run_variants,
    spec_phases,
    step_gb,
)
from timing import copy_bandwidth, events_time, source_commit

from k26.config import ModelConfig
from k26.kv_cache import DrafterCache
from k26.model import AttnBatch, KimiK2, TPInfo
from k26.model.drafter import CompiledDrafter, DFlashDrafter
from k26.model.moe import Int4Experts, MoE, Router
from k26.ops import moe_cuda, pdl
from k26.sampling import RowSampling
from k26.spec.step import SpecConfig, StepModels, speculative_step


def graph_step_time(fn, reset, kernels: list | None = None) -> float:
    """Median replay time of fn captured in one CUDA graph, minus reset()'s; `kernels` (a list) receives
    the kernel list of one replay (kernel_table.record)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
            reset()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def replay():
        reset()
        g.replay()

    t = events_time(replay, reps=15)
    t_reset = events_time(reset, reps=15)
    if kernels is not None:
        kernels += record(replay)
    return max(t - t_reset, 0.0)  # the graph and its memory pool are freed on return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--ctx", default="4096,32768")
    ap.add_argument("--nodes", default="1,8,16,32,64")
    ap.add_argument("--skew", action="store_true")
    ap.add_argument("--breakdown-nodes", default="1,16")
    ap.add_argument(
        "--quick-specs", action="store_true", help="whole-step timings for DFlash and budget 15 only"
    )
    ap.add_argument(
        "--no-specs", action="store_true", help="decode/verify rows only (no whole steps, no draft)"
    )
    ap.add_argument(
        "--seeded-tree",
        action="store_true",
        help="whole steps verify a seeded tree (the drafter still runs): A/Bs of whole steps compare alike",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each decoder layer (one compiled body serves all 61: weights are inputs)",
    )
    ap.add_argument("--variants", default="", help="base,glue,fused,fused-all: see the docstring")
    ap.add_argument(
        "--no-pdl", action="store_true", help="every k26 kernel without programmatic dependent launch"
    )
    ap.add_argument("--table-nodes", default="", help="verify sizes with a per-kernel table (--variants)")
    ap.add_argument(
        "--fused",
        action="store_true",
        help="the step rows on the loader's inference path (KimiK2.fuse_dense_: stacked q_a / kv_a, MLA "
        "projections in the small-M kernel, residual adds + norms as one op); default: the module path",
    )
    ap.add_argument(
        "--split-down",
        action="store_true",
        help="the MoE down GEMM + combine as two launches where one serves (moe_cuda.split_down)",
    )
    ap.add_argument(
        "--route-launch",
        action="store_true",
        help="the MoE expert op routes in its own launch (the router writes no routing table: the A/B)",
    )
    ap.add_argument(
        "--two-launch-moe",
        action="store_true",
        help="one token's MoE block as moe_one_token (two launches), not router + expert op (the A/B)",
    )
    ap.add_argument(
        "--step-kernels",
        action="store_true",
        help="per whole step and the draft forward: one replay's kernels summed by name (kernel_table)",
    )
    ap.add_argument(
        "--drafter-cublas",
        action="store_true",
        help="with --fused, the drafter's own projections on cuBLAS (the A/B side); by default they run as "
        "the loader's do, in the small-M kernel (DFlashDrafter.use_linear_kernel_: q/k/v and gate/up "
        "stacked, one call each; up to layers.KERNEL_MAX_ROWS = 16 rows)",
    )
    ap.add_argument(
        "--dense-mlp-cublas",
        action="store_true",
        help="with --fused, the dense layers' MLP (K2.6: layer 0) on cuBLAS (the A/B side); by default as "
        "the loader runs it, in the small-M kernel (gate / up with SiLU·up one launch)",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if (a.drafter_cublas or a.dense_mlp_cublas) and not a.fused:
        ap.error("--drafter-cublas and --dense-mlp-cublas are A/B sides of --fused's path: pass --fused too")
    if a.fused and a.variants:
        ap.error("--fused applies the loader's path for good; --variants switches paths itself: pick one")
    names = a.variants.split(",") if a.variants else []
    if bad := [v for v in names if v not in VARIANTS]:
        ap.error(f"--variants: unknown {', '.join(map(repr, bad))} (known: {', '.join(VARIANTS)})")
    first_fused = next((i for i, v in enumerate(names) if v.startswith("fused")), len(names))
    if {"base", "glue"} & set(names[first_fused:]):
        ap.error(
            "--variants: base and glue must come before the fused ones (fuse_ stacks the weights for good)"
        )
    pdl.ENABLED = not a.no_pdl  # read at each capture below
    if a.seeded_tree:
        seed_draft_topk(K26_TEXT["vocab_size"], torch.device("cuda"))
    moe_cuda.SPLIT_DOWN = a.split_down
    ctxs, nodes = [int(x) for x in a.ctx.split(",")], [int(x) for x in a.nodes.split(",")]
    a.breakdown_nodes = [int(x) for x in a.breakdown_nodes.split(",") if x]
    cfg = ModelConfig.from_dict(K26_TEXT | {"num_hidden_layers": a.layers})
    ident = lambda x: x
    tp = TPInfo(0, a.tp, all_reduce=ident, all_gather=ident)
    dev = torch.device("cuda")
    with torch.device("meta"):
        model = KimiK2(cfg, torch.bfloat16, tp).requires_grad_(False)
    model.to_empty(device=dev)
    randomize(model, a.skew)
    model.rope.reset_buffers()
    model.eval()
    for m in model.modules():  # as the loader does (moe.use_cuda_kernels): the fused router kernel
        if isinstance(m, Router):
            m.fuse_()
            m.writes_table = not a.route_launch
            m.one_token_block = a.two_launch_moe
    if a.fused:
        model.fuse_dense_()
        if a.dense_mlp_cublas:
            model.fuse_mlp_(kernel=False)
    if a.compile:
        torch._dynamo.config.cache_size_limit = 64  # a body per (variant, N, dense / MoE layer)
        torch._dynamo.config.accumulated_cache_size_limit = (
            512  # fullgraph off: a graph break costs fusion here, it must not abort the measurement
        )
        for layer in model.layers:
            layer.compile(dynamic=False)
    dcfg = drafter_config()
    with torch.device("meta"):
        drafter = DFlashDrafter(dcfg, torch.bfloat16, tp).requires_grad_(False)
    drafter.to_empty(device=dev)
    randomize(drafter, False)
    drafter.rope.reset_buffers()
    if a.fused:
        drafter.fuse_()  # as the loader does
        if not a.drafter_cublas:
            drafter.use_linear_kernel_()
    if a.compile:
        drafter = CompiledDrafter(drafter)  # as the engine's captured steps run it
    copy_bw = copy_bandwidth()
    commit = source_commit()
    nonrouted, routed_all = param_bytes(model, False), param_bytes(model, True)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    per_expert = routed_all / max(moe_layers, 1) / cfg.n_routed_experts
    lines = [
        f"# bench_k26 — {datetime.date.today()}",
        "",
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}; commit {commit}",
        f"- command: `python profiling/bench_k26.py {' '.join(sys.argv[1:])}`",  # as run, every flag
        (
            f"- shapes: rank 0 of TP {a.tp}; {cfg.num_hidden_layers} layers; "
            f"non-routed {nonrouted / 1e9:.2f} GB (embedding table aside: a step reads its rows), "
            f"routed {routed_all / 1e9:.1f} GB ({per_expert / 1e6:.2f} MB per expert per layer); drafter "
            f"{sum(p.numel() * p.element_size() for p in drafter.parameters()) / 1e9:.2f} GB"
        ),
        f"- copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read+write bytes)",
        (
            "- collectives excluded (no-op group); bytes = non-routed params + touched experts "
            "(counted from this step's routing) + the prefix's latent KV + the tokens' embedding rows"
        ),
        "",
        "| step | ctx L | verify N | time ms | experts/layer | GB read | GB/s | % copy BW |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    touched: list[int] = []
    counting = [False]  # the hook syncs with the host: on for one eager pass, off for warm-ups and capture

    def count(mod, args):  # the block's own router on its input: the ids whichever path runs the block
        if counting[0]:
            touched.append(int(mod.gate(args[0].flatten(0, -2))[1].unique().numel()))

    for m in model.modules():
        if isinstance(m, MoE) and isinstance(m.experts, Int4Experts):
            m.register_forward_pre_hook(count)
    counter = (touched, counting)
    if a.variants:
        lines[-2:] = ["| variant | ctx L | verify N | time ms | experts/layer | GB read | GB/s | % copy BW |"]
        lines.append("|---|---|---|---|---|---|---|---|")
        lines += run_variants(
            model, cfg, a, ctxs[0], nodes, counter, (nonrouted, per_expert, copy_bw), graph_step_time
        )
        if a.out:
            with open(a.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        return
    tables: list[str] = []  # --step-kernels, after the step table
    for L in ctxs:
        cache = torch.zeros(
            cfg.num_hidden_layers, 1, L + 512, cfg.latent_dim, dtype=torch.bfloat16, device=dev
        )
        dcache = DrafterCache.allocate(dcfg, 1, L + 512, torch.bfloat16, dev, tp_size=a.tp)
        rows, start = torch.zeros(1, dtype=torch.long, device=dev), torch.full((1,), L, device=dev)
        kv_bytes = cfg.num_hidden_layers * L * cfg.latent_dim * 2
        for N in nodes:
            ids = token_ids(N, cfg.vocab_size, dev)
            anc = torch.ones(N, N, dtype=torch.bool, device=dev).tril()[None]
            batch = AttnBatch.tree(start, anc, rows, static=True)  # sync-free, as under graphs

            def verify(ids=ids, batch=batch, cache=cache):  # bound now: called within this iteration
                h, _ = model(ids, batch, cache, aux_layers=dcfg.target_layer_ids)
                model.logits(h)

            experts = experts_touched(verify, counter)
            t = graph_step_time(verify, lambda: None)
            gb = step_gb(nonrouted, experts * per_expert * moe_layers, kv_bytes, N, cfg)
            lines.append(
                f"| {'decode' if N == 1 else 'verify'} | {L} | {N} | {t * 1e3:.2f} | {experts:.0f} | "
                f"{gb:.2f} | {gb / t:.0f} | {100 * gb * 1e9 / t / copy_bw:.0f}% |"
            )
            print(lines[-1], flush=True)
        bonus = torch.randint(0, cfg.vocab_size, (1,), device=dev)
        alive = torch.ones(1, dtype=torch.bool, device=dev)
        sp = RowSampling.of([None], dev)
        specs = (
            ()
            if a.no_specs
            else (SpecConfig("dflash"), SpecConfig("ddtree", 15))
            if a.quick_specs
            else (
                SpecConfig("dflash"),
                SpecConfig("ddtree", 8),
                SpecConfig("ddtree", 15),
                SpecConfig("ddtree", 31),
            )
        )
        for spec in specs:
            st = start.clone()

            def step(
                st=st, spec=spec, cache=cache, dcache=dcache, rows=rows, bonus=bonus, alive=alive, sp=sp
            ):
                speculative_step(
                    StepModels(model, drafter, cache, dcache, static=True, compiled=a.compile),
                    rows,
                    st,
                    bonus,
                    alive,
                    spec,
                    sp,
                )

            kernels: list | None = [] if a.step_kernels else None
            t = graph_step_time(step, lambda st=st, start=start: st.copy_(start), kernels)
            what = f"whole {spec.method}{'' if spec.method == 'dflash' else f' budget {spec.budget}'} step"
            n_ver = 8 if spec.method == "dflash" else spec.budget + 1
            lines.append(f"| {what} | {L} | {n_ver} | {t * 1e3:.2f} | | | | |")
            print(lines[-1], flush=True)
            if kernels:
                tables += by_name(kernels, f"{what}, L = {L}") + spec_phases(kernels)
        if not a.no_specs:
            dstart = start.clone()

            def draft_only(dcache=dcache, rows=rows, dstart=dstart, bonus=bonus):
                from k26.spec.step import draft

                draft(model, drafter, dcache, rows, dstart, bonus, static=True)

            kernels = [] if a.step_kernels else None
            t = graph_step_time(draft_only, lambda: None, kernels)
            lines.append(f"| draft forward (drafter + lm_head shard) | {L} | 8 | {t * 1e3:.2f} | | | | |")
            print(lines[-1], flush=True)
            if kernels:
                tables += by_name(kernels, f"draft forward, L = {L}")
        del cache, dcache
        torch.cuda.empty_cache()
    lines += tables + breakdown(model, cfg, dcfg, dev, ctxs[0], a.breakdown_nodes)
    print("\n".join(lines[-40:]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def breakdown(model, cfg, dcfg, dev, L, nodes) -> list[str]:
    """Device time per kernel category of one eager verify step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    out = [
        "",
        f"Per-op breakdown, one eager step at L = {L} (torch.profiler device time):",
        "",
        "| N | category | kernels | µs | share |",
        "|---|---|---|---|---|",
    ]
    cache = torch.zeros(cfg.num_hidden_layers, 1, L + 512, cfg.latent_dim, dtype=torch.bfloat16, device=dev)
    rows, start = torch.zeros(1, dtype=torch.long, device=dev), torch.full((1,), L, device=dev)
    for N in nodes:
        ids = token_ids(N, cfg.vocab_size, dev)
        batch = AttnBatch.tree(
            start, torch.ones(N, N, dtype=torch.bool, device=dev).tril()[None], rows, static=True
        )
        model(ids, batch, cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            h, _ = model(ids, batch, cache)
            model.logits(h)
            torch.cuda.synchronize()
        evs = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in evs)
        by_cat: dict[str, list] = {}
        for e in evs:  # the per-kernel table's categories (kernel_table.CATEGORIES): one list of names
            by_cat.setdefault(category(e.key), []).append(e)
        for name, sel in sorted(by_cat.items(), key=lambda kv: -sum(e.device_time_total for e in kv[1])):
            t = sum(e.device_time_total for e in sel)
            out.append(f"| {N} | {name} | {sum(e.count for e in sel)} | {t:.0f} | {100 * t / total:.0f}% |")
        out.append(f"| {N} | **total** | {sum(e.count for e in evs)} | {total:.0f} | 100% |")
    return out


if __name__ == "__main__":
    main()
