"""Timeline of one MoE block (router, then the expert op with the shared expert) as the model runs it:
CUDA-graph replay after a 256 MB L2 flush, at the TP8 rank's shapes (E = 384, D = 7168, I = 256, top-8),
with the router's and the expert kernels' phase stamps (library built with -DK26_ROUTER_TRACE
-DK26_MOE_TRACE), all in µs from the router's first block.

    python profiling/debug/moe_trace.py --m 1 [--lib traced.so]

--lib: a library built with those flags (e.g. on the CPU machine: phases.build_traced's nvcc line);
without it the script builds one. A kernel stamps only its first 1024 blocks (all of them at M = 1).
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
barrier = router_barrier("cuda")
x = torch.randn(a.m, D, generator=gen, device="cuda").bfloat16()


def block() -> torch.Tensor:
    tw, ids = torch.ops.k26.moe_router(x, router_w, bias, barrier, 1, 1, K, True, 2.827)
    return torch.ops.k26.moe_w4a16_repacked(x, *experts, ids, tw, *shared)


block()
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    block()
flush = torch.ones(64 << 20, device="cuda")  # 256 MB, read between launches: cold L2 without dirty lines
for _ in range(4):  # the last replay is the one read back
    flush.sum()
    assert lib.k26_moe_router_trace_reset() == 0 and lib.k26_moe_trace_reset() == 0
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()

router = read_tables(lib.k26_moe_router_trace)[0]
moe = read_tables(lib.k26_moe_trace, tables=2)
t0 = first_start(router)
print(f"M = {a.m}: µs from the router's first block")
print("router")
stamps = {0: "start", 1: "dot done", 2: "partials written", 3: "phase 2 begins", 5: "top-k written"}
print_table(router, stamps, t0)
names = {0: "start", 1: "group known (waited)", 2: "loop done", 3: "written"}
# A block's row: group * (I / 8 gate/up tiles) + tile; the shared expert's ceil(M / (8 nt)) groups come first.
shared_groups = -(-a.m // (8 * pick_nt(a.m * K, E)))
shared_rows = torch.arange(1024) < shared_groups * (I // 8)
print("gate/up GEMM, shared-expert blocks")
print_table(moe[0], names, t0, shared_rows)
print("gate/up GEMM, routed blocks")
print_table(moe[0], names, t0, ~shared_rows)
print("down (+ combine at M = 1)")
print_table(moe[1], names, t0)
