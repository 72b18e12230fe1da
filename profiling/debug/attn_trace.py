"""Per-phase timestamps of the MLA tree-attention kernel (row tile 0, sequence 0, every split): builds a
copy of the kernel with -DK26_ATTN_TRACE, runs one shape, prints when each split started, had Q, left its
key loop, passed the cluster barrier, finished the cluster merge, and, for the split that counted last on a
column slice's counter, when it knew and when it had merged that slice over every cluster (µs from the
first block's start).

    python profiling/debug/attn_trace.py --n 1 --l 4096
"""

import argparse
import ctypes

import torch
from phases import build_traced, print_phases

from k26.ops import attention_cuda, tree_mask_to_words

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=1)
ap.add_argument("--h", type=int, default=8)
ap.add_argument("--l", type=int, default=4096)
ap.add_argument(
    "--min-keys", type=int, default=None, help="keys per split at least (default: the front door's)"
)
ap.add_argument("--warm", action="store_true", help="no 256 MB read before each launch (warm L2 and TLB)")
ap.add_argument("--cflags", default="", help="extra nvcc flags, e.g. --cflags=-DMERGE_LOADS=4")
a = ap.parse_args()
so = build_traced(["mla_tree_attn.cu"], ["-DK26_ATTN_TRACE", *a.cflags.split()])
lib = ctypes.CDLL(so)
attention_cuda._bind(lib)
gen = torch.Generator(device="cuda").manual_seed(0)
cache = torch.randn(1, a.l + a.n, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
q = torch.randn(1, a.n, a.h, 576, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.3
words = tree_mask_to_words(torch.ones(1, a.n, a.n, dtype=torch.bool).tril()).cuda()
rows, prefix = torch.zeros(1, dtype=torch.long, device="cuda"), torch.full((1,), a.l, device="cuda")
out = torch.empty(1, a.n, a.h, 512, dtype=torch.bfloat16, device="cuda")
lse = torch.empty(1, a.n, a.h, dtype=torch.float32, device="cuda")
S = attention_cuda.PLANS.plan(lib, q.device, 1, a.n, a.h)
ws = attention_cuda.PLANS.workspace(lib, q.device, 1, a.n, a.h, S)
mk = a.min_keys or attention_cuda.min_split_keys(lib.k26_mla_tree_attn_tile_rows(a.n, a.h))
flush = torch.ones(64 << 20, device="cuda")  # 256 MB, read between launches: cold L2 without dirty lines
for _ in range(4):
    if not a.warm:
        flush.sum()
    assert lib.k26_mla_tree_attn_trace_reset() == 0
    torch.cuda.synchronize()
    err = lib.k26_mla_tree_attn(
        q.data_ptr(),
        cache.data_ptr(),
        rows.data_ptr(),
        prefix.data_ptr(),
        words.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        ws.data_ptr(),
        1,
        a.n,
        a.h,
        words.shape[2],
        cache.shape[1],
        S,
        mk,
        ctypes.c_float(0.1),
        None,  # q_pe, pe_ld, positions, inv_freq: the plain query
        0,
        None,
        None,
        0,  # the merge in the kernel (defer_max)
        0,  # no programmatic dependent launch
        torch.cuda.current_stream().cuda_stream,
    )
    assert err == 0, err
    torch.cuda.synchronize()
names = {
    0: "start",
    1: "Q in regs",
    2: "key loop done",
    3: "barrier passed",
    4: "first loads used",
    5: "first combined",
    7: "share merged",
}
print_phases(lib.k26_mla_tree_attn_trace, names, f"S={S} min_keys={mk} splits")
