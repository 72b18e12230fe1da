"""Dump the fused MoE kernel's intermediates (routing table, act, y, out) against the reference.

python profiling/debug/moe_debug.py            # the dumps
python profiling/debug/moe_debug.py --router   # only the router kernel at the TP8 shape, M = 1 (a target
                                               # for ncu --kernel-name regex:router_kernel)
python profiling/debug/moe_debug.py --op hot10 64   # only the expert op (+ shared expert) at the TP8 shape,
                                               # the routing kind and M given, 3 launches (a target for
                                               # ncu --kernel-name regex:gemm_kernel --launch-skip 2 -c 2)
At M = 1 the op is two launches (gate/up gemm_kernel, down_combine_one_token): it routes directly (no
table) and never writes y, so the dumps use M >= 2, with the down GEMM + combine launches (flags bit 1;
csrc/moe_down_combine.cuh, the default for a few tokens, keeps y in shared memory).
"""

import sys

import torch
import torch.nn.functional as F

from k26.ops.moe_cuda import _library as library  # with the op's ctypes signatures
from k26.ops.moe_cuda import route_table_groups, route_table_size
from k26.ops.moe_layout import unrepack, w13_row_order

sys.path.insert(0, "tests")
from test_moe_gpu import random_repacked, routing


def al(v):
    return (v + 255) & ~255


def run(E, K, D, I, M, kind, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13, s13, w2, s2 = random_repacked(E, D, I, gen)
    x = torch.randn(M, D, generator=gen, device="cuda").to(torch.bfloat16)
    ids = routing(kind, M, E, K, gen)
    tw = torch.rand(M, K, generator=gen, device="cuda") + 0.1
    lib = library()
    nt = 1
    nbytes = lib.k26_moe_w4a16_workspace(M, D, I, E, K, nt, 0)  # no shared expert
    ws = torch.full((nbytes,), 255, dtype=torch.uint8, device="cuda")
    out = torch.full((M, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    err = lib.k26_moe_w4a16(
        x.data_ptr(),
        w13.data_ptr(),
        s13.data_ptr(),
        w2.data_ptr(),
        s2.data_ptr(),
        ids.data_ptr(),
        tw.data_ptr(),
        out.data_ptr(),
        ws.data_ptr(),
        M,
        D,
        I,
        E,
        K,
        nt,
        None,
        None,
        None,
        None,  # no table: the op's own route_kernel writes it into the workspace
        2,  # flags: no PDL; the down GEMM + combine launches (y in the workspace, not in shared memory)
        torch.cuda.current_stream().cuda_stream,
    )
    torch.cuda.synchronize()
    P = M * K
    G = route_table_groups(M, K, E, nt, False)
    off = 0

    def take(n):
        nonlocal off
        t = ws[off : off + n]
        off += al(n)
        return t

    table = take(route_table_size(M, K, E, nt, False) * 4).view(torch.int32)  # csrc/moe_route.cuh
    ng, sorted_ = table[:1], table[1 : 1 + P]
    ge, gs, gl = table[1 + P :].view(3, G)
    act = take(P * I * 2).view(torch.bfloat16).view(P, I)
    y = take(P * D * 2).view(torch.bfloat16).view(P, D)
    n = int(ng[0])
    print("err", err, "ids", ids.tolist(), "num_groups", n)
    print("sorted", sorted_.tolist())
    print("ge", ge[:n].tolist(), "gs", gs[:n].tolist(), "gl", gl[:n].tolist())
    order = w13_row_order(I)

    def deq(q, s):
        return (q.float() * s.float().repeat_interleave(32, -1)).to(torch.bfloat16)

    flat = ids.flatten()
    for slot in range(P):
        p = int(sorted_[slot])
        e = int(flat[p])
        tok = p // K
        q13, sc13 = unrepack(w13[e : e + 1], s13[e : e + 1], order)
        q2, sc2 = unrepack(w2[e : e + 1], s2[e : e + 1])
        W = deq(q13[0], sc13[0])
        Wd = deq(q2[0], sc2[0])
        g = F.linear(x[tok : tok + 1], W[:I])
        u = F.linear(x[tok : tok + 1], W[I:])
        a = F.silu(g) * u
        yy = F.linear(a, Wd)
        ea = ((act[slot].float() - a[0].float()).norm() / a.float().norm()).item()
        ey = ((y[p].float() - yy[0].float()).norm() / yy.float().norm()).item()
        # y from the kernel's own act
        yk = F.linear(act[slot : slot + 1], Wd)
        eyk = ((y[p].float() - yk[0].float()).norm() / yk.float().norm()).item()
        print(
            f"slot {slot} pair {p} tok {tok} e {e}: act err {ea:.3g}  y err {ey:.3g}  y-vs-own-act {eyk:.3g}"
        )
    from k26.ops.moe_cuda import repacked_reference

    ref = repacked_reference(x, w13, s13, w2, s2, ids, tw).float()
    print("out err per token", [((out[t].float() - ref[t]).norm() / ref[t].norm()).item() for t in range(M)])


def router_only(reps: int = 3) -> None:
    from k26.ops.router_cuda import router_barrier

    gen = torch.Generator(device="cuda").manual_seed(0)
    E, D = 384, 7168
    x = torch.randn(1, D, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(E, D, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, generator=gen, device="cuda") * 0.05
    barrier = router_barrier("cuda")
    for _ in range(reps):
        torch.ops.k26.moe_router(x, w, bias, barrier, 1, 1, 8, True, 2.827)
    torch.cuda.synchronize()


def op_only(kind: str, M: int, reps: int = 3) -> None:
    from test_moe_gpu import block_inputs

    _, w, sh, x, ids, tw = block_inputs(0, M, 384, 8, 7168, 256, kind)
    for _ in range(reps):
        torch.ops.k26.moe_w4a16_repacked(x, *w, ids, tw, *sh)
    torch.cuda.synchronize()


if "--router" in sys.argv:
    router_only()
elif "--op" in sys.argv:
    i = sys.argv.index("--op")
    op_only(sys.argv[i + 1], int(sys.argv[i + 2]))
else:
    run(8, 2, 64, 64, 2, "uniform", 1)
    run(64, 8, 256, 64, 8, "each_once", 3)
