"""Timeline of one MoE block (router, then the expert op with the shared expert) as the model runs it:
CUDA-graph replay after a 256 MB L2 flush, at the TP8 rank's shapes (E = 384, D = 7168, I = 256, top-8),
with the router's and the expert kernels' phase stamps (library built with -DK26_ROUTER_TRACE
-DK26_MOE_TRACE), all in µs from the router's first block.

    python profiling/debug/moe_trace.py --m 1 [--hot 10] [--lib traced.so] [--warm-tlb]

--hot N: N random experts get a large correction bias, so every token picks 8 of those N (bench_moe --block's
skewed routing; 0: a trained-like router's spread).
--lib: a library built with those flags (e.g. on the CPU machine: phases.build_traced's nvcc line);
without it the script builds one. A kernel stamps only its first 1024 blocks (all of them at M = 1).
--warm-tlb: before each replay (after the flush) read one word per 4 KB of the chosen experts' weights, so
their address translations are cached and their bytes are not: a cold-TLB cost shows as the difference.
Also printed: the routed gate/up blocks' loop time grouped by how many gate/up blocks shared their SM.
"""

import argparse
import ctypes
import os
import sys
from pathlib import Path

import torch
from phases import build_traced, first_start, print_table, read_tables

ap = argparse.ArgumentParser()
ap.add_argument("--m", type=int, default=1)
ap.add_argument("--lib", default=None)
ap.add_argument("--warm-tlb", action="store_true")
ap.add_argument("--hot", type=int, default=0)
a = ap.parse_args()
flags = ["-DK26_ROUTER_TRACE", "-DK26_MOE_TRACE"]
lib_path = a.lib or build_traced(["moe_router.cu", "moe_w4a16.cu"], flags)
os.environ["K26_OPS_LIB"] = lib_path  # read by build.library() at the ops' first call
lib = ctypes.CDLL(lib_path)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_moe_gpu import random_repacked, shared_weights

from k26.ops.moe_cuda import pick_nt
from k26.ops.router_cuda import router_barrier

E, K, D, I = 384, 8, 7168, 256
gen = torch.Generator(device="cuda").manual_seed(0)
experts, shared = random_repacked(E, D, I, gen), shared_weights(D, I, gen)
router_w = (torch.randn(E, D, generator=gen, device="cuda") * D**-0.5).bfloat16()
bias = torch.randn(E, generator=gen, device="cuda") * 0.01
if a.hot:
    bias[torch.randperm(E, generator=gen, device="cuda")[: a.hot]] += 10.0
barrier = router_barrier("cuda")
x = torch.randn(a.m, D, generator=gen, device="cuda").bfloat16()


def block() -> torch.Tensor:
    tw, ids = torch.ops.k26.moe_router(x, router_w, bias, barrier, 1, 1, K, True, 2.827)
    return torch.ops.k26.moe_w4a16_repacked(x, *experts, ids, tw, *shared)


block()
torch.cuda.synchronize()
_, chosen = torch.ops.k26.moe_router(x, router_w, bias, barrier, 1, 1, K, True, 2.827)
pages = []
for w in (experts[0], experts[2]):  # the chosen experts' packed gate/up and down words, one int32 per 4 KB
    flat = w.view(E, -1)
    pages.append((flat, chosen.unique().view(-1, 1), torch.arange(0, flat.shape[1], 1024, device="cuda")))
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    block()
flush = torch.ones(64 << 20, device="cuda")  # 256 MB, read between launches: cold L2 without dirty lines
for _ in range(4):  # the last replay is the one read back
    flush.sum()
    if a.warm_tlb:
        for flat, rows, cols in pages:
            flat[rows, cols].sum()
    assert lib.k26_moe_router_trace_reset() == 0 and lib.k26_moe_trace_reset() == 0
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()

router = read_tables(lib.k26_moe_router_trace)[0]
moe = read_tables(lib.k26_moe_trace, tables=2)
t0 = first_start(router)
print(
    f"M = {a.m}, hot experts {a.hot or 'none'}: µs from the router's first block; experts touched "
    f"{int(chosen.unique().numel())}"
)
print("router")
stamps = {0: "start", 1: "dot done", 2: "partials written", 3: "phase 2 begins", 5: "top-k written"}
print_table(router, stamps, t0)
names = {0: "start", 1: "group known (waited)", 4: "first batch (warp 0)", 2: "loop done", 3: "written"}
# A block's row: group * (I / 8 gate/up tiles) + tile; the shared expert's ceil(M / (8 nt)) groups come first.
shared_groups = -(-a.m // (8 * pick_nt(a.m * K, E)))
x_blocks = I // 8 // (1 if a.m * K <= 64 else 2)  # gate/up tiles per block: csrc/moe_w4a16.cu's RT1
shared_rows = torch.arange(1024) < shared_groups * x_blocks
print("gate/up GEMM, shared-expert blocks")
print_table(moe[0], names, t0, shared_rows)
print("gate/up GEMM, routed blocks")
print_table(moe[0], names, t0, ~shared_rows)
print("down (+ combine at M = 1)")
print_table(moe[1], names | {5: "waited (warp 0)", 6: "shared expert done (warp 0)"}, t0)

# Blocks per SM (stamp 15 = smid + 1): does a routed block's loop take longer where more gate/up blocks share
# its SM (a per-SM bandwidth limit) or is the spread independent of it (the memory system's service order)?
sm0, sm1 = moe[0][:, 15].long() - 1, moe[1][:, 15].long() - 1
per_sm = torch.bincount(sm0[sm0 >= 0], minlength=256)
down_sm = torch.bincount(sm1[sm1 >= 0], minlength=256)
routed = (moe[0][:, 1] > 0) & (moe[0][:, 2] > 0) & ~shared_rows
loop = (moe[0][:, 2] - moe[0][:, 1]) / 1e3
print("routed gate/up loop (µs) by gate/up blocks on the SM / down blocks on the SM")
for n in sorted(set(per_sm[sm0[routed]].tolist())):
    sel = routed & (per_sm[sm0.clamp(min=0)] == n)
    q = loop[sel].quantile(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)).tolist()
    dn = down_sm[sm0[sel]].double().mean().item()
    print(
        f"  {n} gate/up blocks: n={int(sel.sum()):4d} loop min {q[0]:.2f} median {q[1]:.2f} max {q[2]:.2f}"
        f"  (down blocks there: {dn:.1f} on average)"
    )
