"""The whole MoE block for `bench_moe.py --block`: normed hidden in, block output out (before the
all-reduce), as `k26/model/moe.py` runs it on CUDA, against the block with the shared expert as separate
GEMMs and the block before issue 17 (reference router, separate shared expert). Columns: bench_moe.py."""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F
from timing import capture, graph_time_cold, mma_sync_peak

from k26.ops import moe_cuda, pdl, reference
from k26.ops.router_cuda import router_barrier

SHAPES = {
    "tp8": {"E": 384, "D": 7168, "I": 256, "K": 8, "layers": 8},
    "tp1": {"E": 384, "D": 7168, "I": 2048, "K": 8, "layers": 2},
}


def expert_bytes(D: int, I: int) -> int:
    params = 3 * D * I
    return params // 2 + params // 32 * 2  # int4 + one bf16 scale per 32


ROUTE = (1, 1, 8, True, 2.827)  # K2.6: n_group, topk_group, top-k, renormalise, routed_scaling_factor


def block_layer(E: int, D: int, I: int, hot: int, gen: torch.Generator) -> dict:
    """One layer's MoE weights at random: router like a trained one, `hot` experts favoured by the bias."""

    def words(*s):
        return torch.randint(-(2**31), 2**31 - 1, s, generator=gen, dtype=torch.int32, device="cuda")

    def scales(*s):
        return (torch.rand(*s, generator=gen, device="cuda") * 0.02 + 1e-3).to(torch.bfloat16)

    def bf(*s):
        return (torch.randn(*s, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)

    bias = torch.randn(E, generator=gen, device="cuda") * 0.05
    if hot:
        bias[torch.randperm(E, generator=gen, device="cuda")[:hot]] += 10.0
    experts = (
        words(E, I // 8, D // 64, 32, 4),
        scales(E, I // 8, D // 64, 16, 2),
        words(E, D // 16, I // 64, 32, 4),
        scales(E, D // 16, I // 64, 16, 2),
    )
    return {
        "router": bf(E, D),
        "bias": bias,
        "barrier": router_barrier("cuda"),
        "experts": experts,
        "gate": bf(I, D),
        "up": bf(I, D),
        "down": bf(D, I),
    }


def moe_block(x: torch.Tensor, lw: dict, mode: str = "fused") -> torch.Tensor:
    """What MoE.forward runs on CUDA (bf16, repacked experts), without the TP all-reduce. mode "fused":
    router kernel (writing the routing table for M > 1 unless the expert op groups the pairs from the ids:
    moe_cuda.groups_from_ids), shared expert in the expert kernel's grids;
    "route": for M > 1 the same but the expert op routes in its own launch (before the router wrote the
    table), for one token `moe_one_token` (the router kernel runs the gate/up GEMMs: two launches, opt-in);
    "router": router kernel, shared expert as its own three GEMMs; "unfused": the reference router (fp32
    weight copy, GEMV, topk), separate shared expert."""
    M = x.shape[0]
    sh = (lw["gate"], lw["up"], lw["down"])
    if mode == "route" and M == 1:
        router = (lw["router"], lw["bias"], lw["barrier"], *ROUTE)
        return torch.ops.k26.moe_one_token(x, *router, *lw["experts"], *sh)
    E, D = lw["router"].shape
    own = moe_cuda.groups_from_ids(M, ROUTE[2], E, D, lw["gate"].shape[0], True)  # as MoE._wants_table
    if mode == "fused" and M > 1 and not own:
        route = (x, lw["router"], lw["bias"], lw["barrier"], *ROUTE, True)
        tw, ids, table = torch.ops.k26.moe_router_table(*route)
        return torch.ops.k26.moe_w4a16_repacked(x, *lw["experts"], ids, tw, *sh, table)
    if mode == "unfused":
        tw, ids = reference.moe_router(x, lw["router"], lw["bias"], *ROUTE)
    else:
        tw, ids = torch.ops.k26.moe_router(x, lw["router"], lw["bias"], lw["barrier"], *ROUTE)
    if mode in ("fused", "route"):
        return torch.ops.k26.moe_w4a16_repacked(x, *lw["experts"], ids, tw, *sh)
    y = torch.ops.k26.moe_w4a16_repacked(x, *lw["experts"], ids, tw)
    return y + F.linear(F.silu(F.linear(x, lw["gate"])) * F.linear(x, lw["up"]), lw["down"])


def launches(fn) -> list[str]:
    """Names of the CUDA kernels one replay of fn's graph runs (the profiler sees graph kernels via CUPTI)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    g = capture(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    return [ev.name for ev in prof.events() if ev.device_type == DeviceType.CUDA and "Mem" not in ev.name]


def no_pdl_time(fn, calls: int) -> float:
    """graph_time_cold of fn with every kernel launched without programmatic dependent launch."""
    with pdl.disabled():  # read at capture
        return graph_time_cold(fn, calls)


def bench_block(
    name: str, shp: dict, ms: list[int], copy_bw: float, rows: list[str], kernels: list[str], quick: bool
) -> None:
    E, D, I, L = shp["E"], shp["D"], shp["I"], shp["layers"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for kind, hot in (("uniform", 0), ("skewed", 10)):
        layers = [block_layer(E, D, I, hot, gen) for _ in range(L)]
        for M in ms:
            x = torch.randn(M, D, generator=gen, device="cuda").to(torch.bfloat16)
            touched = statistics.mean(
                int(
                    torch.ops.k26.moe_router(x, lw["router"], lw["bias"], lw["barrier"], *ROUTE)[1]
                    .unique()
                    .numel()
                )
                for lw in layers
            )
            mb = (E * D * 2 + 3 * D * I * 2 + touched * expert_bytes(D, I)) / 1e6

            def blocks(mode, x=x, layers=layers):
                return [moe_block(x, lw, mode) for lw in layers]

            def routers(x=x, layers=layers):
                return [
                    torch.ops.k26.moe_router(x, lw["router"], lw["bias"], lw["barrier"], *ROUTE)
                    for lw in layers
                ]

            t = graph_time_cold(lambda: blocks("fused"), L)
            t_route = graph_time_cold(lambda: blocks("route"), L)
            t_no_pdl = no_pdl_time(lambda: blocks("fused"), L)
            t_unfused = math.nan if quick else graph_time_cold(lambda: blocks("unfused"), L)
            t_router_only = math.nan if quick else graph_time_cold(lambda: blocks("router"), L)
            t_router = graph_time_cold(routers, L)
            n_fused, n_unfused = "-", "-"
            if M in (1, 64):  # the profiler is slow to start; the count is the same for other M
                k_fused = launches(lambda x=x, lw=layers[0]: moe_block(x, lw))
                k_unfused = [] if quick else launches(lambda x=x, lw=layers[0]: moe_block(x, lw, "unfused"))
                n_fused, n_unfused = len(k_fused), len(k_unfused) or "-"
                if M == 1 and name == "tp8" and kind == "uniform":
                    kernels.extend(
                        [
                            f"- fused: {', '.join(k[:60] for k in k_fused)}",
                            f"- before: {', '.join(k[:60] for k in k_unfused)}",
                        ]
                    )
            gbs = mb / 1e3 / t
            rows.append(
                f"| {name} | {kind} | {M} | {touched:.1f} | {mb:.1f} | {t * 1e6:.1f} | {gbs:.0f} | "
                f"{100 * gbs * 1e9 / copy_bw:.1f}% | {t_route * 1e6:.1f} | {t_no_pdl * 1e6:.1f} | "
                f"{t_router_only * 1e6:.1f} | {t_unfused * 1e6:.1f} | "
                f"{n_fused} / {n_unfused} | "
                f"{t_router * 1e6:.1f} ({100 * E * D * 2 / t_router / copy_bw:.0f}%) |"
            )
            print(rows[-1], flush=True)
        del layers
        torch.cuda.empty_cache()


def block_main(a, copy_bw: float, head: list[str]) -> str:
    head += [
        f"- mma.sync bf16 peak measured in this run: {mma_sync_peak() / 1e12:.0f} TFLOP/s",
        "",
        (
            "| shape | routing | M | experts touched | block MB | block µs | GB/s | % copy | "
            "alternative µs (M 1: moe_one_token, 2 launches; else own route launch) | no PDL µs | "
            "shared separate µs | before (unfused) µs | "
            "launches fused / before | router µs (% copy) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    rows: list[str] = []
    kernels: list[str] = []  # of one captured block (TP8, M = 1, uniform)
    for name in a.shapes.split(","):
        bench_block(name, SHAPES[name], [int(v) for v in a.ms.split(",")], copy_bw, rows, kernels, a.quick)
    tail = ["", "Kernels of one captured block (TP8, M = 1, uniform), in launch order:", "", *kernels]
    print("\n".join(tail))
    return "\n".join(head + rows + tail) + "\n"
