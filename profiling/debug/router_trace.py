"""Per-phase timestamps of the fused MoE router kernel (every block): builds csrc/moe_router.cu with
-DK26_ROUTER_TRACE, runs `torch.ops.k26.moe_router` on it at K2.6's router shape (E = 384, D = 7168, top-8)
for M tokens after a 256 MB L2 flush, and prints when the blocks started, had their weight tile's dot
products, wrote their partials, passed the barrier (one token: the last block in), and had the scores and
the top-k (µs from the first start).

    python profiling/debug/router_trace.py --m 1 [--table] [--cflags "-DFOO"]

--table runs moe_router_table (the expert op's routing table built by the last block, the model's path for
more than one token): its "routing table built" stamp shows what the table adds to the router's tail.
"""

import argparse
import ctypes
import os

import torch
from phases import build_traced, print_phases

from k26.ops import router_cuda

ap = argparse.ArgumentParser()
ap.add_argument("--m", type=int, default=1)
ap.add_argument("--e", type=int, default=384)
ap.add_argument("--d", type=int, default=7168)
ap.add_argument("--cflags", default="", help="extra nvcc flags")
ap.add_argument("--table", action="store_true", help="moe_router_table (with the shared expert's slots)")
a = ap.parse_args()
os.environ["K26_OPS_LIB"] = build_traced(["moe_router.cu"], ["-DK26_ROUTER_TRACE", *a.cflags.split()])
lib = ctypes.CDLL(os.environ["K26_OPS_LIB"])  # the op loads the same library: one trace table

gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(a.m, a.d, device="cuda", generator=gen).bfloat16()
w = (torch.randn(a.e, a.d, device="cuda", generator=gen) * a.d**-0.5).bfloat16()
bias = torch.randn(a.e, device="cuda", generator=gen) * 0.01
barrier = router_cuda.router_barrier("cuda")
flush = torch.ones(64 << 20, device="cuda")  # 256 MB, read between launches: cold L2 without dirty lines
for _ in range(4):  # the last launch is the one read back
    flush.sum()
    assert lib.k26_moe_router_trace_reset() == 0
    torch.cuda.synchronize()
    if a.table:
        out_w, out_ids, _ = torch.ops.k26.moe_router_table(x, w, bias, barrier, 1, 1, 8, True, 2.827, True)
    else:
        out_w, out_ids = torch.ops.k26.moe_router(x, w, bias, barrier, 1, 1, 8, True, 2.827)
    torch.cuda.synchronize()
ref_w, ref_ids = router_cuda.reference.moe_router(x, w, bias, 1, 1, 8, True, 2.827)
same = (out_ids.sort(-1).values == ref_ids.sort(-1).values).all(-1).float().mean().item()
err = (out_w.sort(-1).values - ref_w.sort(-1).values).abs().max()
print(f"top-k sets equal to the reference on {same:.3f} of rows; sorted weights max err {err:.2e}")
names = {0: "start", 1: "dot done", 2: "partial written", 3: "barrier passed", 4: "scores"}
names |= {6: "keys loaded", 7: "warp picks", 8: "candidates in", 9: "final picks", 10: "written"}
names[5] = "top-k done"
names[11] = "routing table built"  # --table only
print_phases(lib.k26_moe_router_trace, names, f"M={a.m} blocks")
