"""The small-M linear op against the streaming floor of its bytes, per K2.6 / drafter projection.

    python profiling/bench_linear.py [--tp 8,1] [--ms 1,16,64] [--sweep] [--out FILE.md]

Each row times one projection inside a CUDA graph that runs it R times in a row over R distinct weight
copies (R x bytes >= 320 MB, so no copy sits in L2 between calls, as in a real step); time = replay / R,
median of replays. In the same run and the same way:
  - floor: a pure read of the same weight bytes as one kernel (16-byte loads, four in flight per thread,
    256 threads per block, best grid of 1 / 4 / 8 blocks per SM, loads issued before the grid-dependency
    wait, programmatic dependent launch on), written below (FLOOR_CU) and built with nvcc at start;
  - k26: `torch.ops.k26.linear` / `linear_grouped` through its launcher, PDL on (and off: "no PDL"); rows
    named "SiLU·up": `torch.ops.k26.linear_swiglu` (the gate / up stack with SiLU·up in its epilogue);
  - cuBLAS: F.linear (or the einsum of the grouped shapes; F.linear, F.silu and the product for SiLU·up),
    what the model ran before.
"x floor" = k26 / floor: the target is <= 1.2 at M = 1 and M = 16. "% copy" = weight bytes / time against
the eager device-to-device copy rate (read + write bytes) measured at start. `--sweep` adds the best
split count found by trying 1..32 splits next to the planned one.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import build_cu, copy_bandwidth, events_time, source_commit

from k26.ops import pdl
from k26.ops.linear_cuda import launch, plan_splits

FLOOR_CU = r"""
#include <cuda_runtime.h>
#include <stdint.h>
// Coherent (not .nc): ptxas moves .nc loads across griddepcontrol.wait, and sank these below it (their SASS
// began with the wait until 2026-12-05: the floor had no load in flight across it; scripts/sass_schedule.py).
__device__ __forceinline__ uint4 ld(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__global__ void __launch_bounds__(256) stream_read(const uint4* p, long long n, uint4* sink) {
  const long long s = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  uint4 v[4], acc = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = i + j * s < n ? ld(p + i + j * s) : make_uint4(0, 0, 0, 0);
  cudaGridDependencySynchronize();
  while (true) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc.x ^= v[j].x, acc.y ^= v[j].y, acc.z ^= v[j].z, acc.w ^= v[j].w;
    i += 4 * s;
    if (i >= n) break;
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i + j * s < n ? ld(p + i + j * s) : make_uint4(0, 0, 0, 0);
  }
  cudaTriggerProgrammaticLaunchCompletion();
  if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u) *sink = acc;  // keeps the loads alive; never true
}
extern "C" int stream_read_launch(const void* p, long long bytes, void* sink, int grid, void* stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid); cfg.blockDim = dim3(256); cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = a; cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, stream_read, (const uint4*)p, bytes / 16, (uint4*)sink);
}
"""

H, Q_LORA, KV_LORA, ROPE, NOPE, V, INTER, VOCAB = 7168, 1536, 512, 64, 128, 128, 18432, 163840


def shapes(tp: int) -> list[tuple[str, int, int, int]]:
    """(name, G, N, K) of every dense projection at one rank of TP `tp` (G > 1: one matrix per head)."""
    heads = 64 // tp
    return [
        ("q_a+kv_a", 1, Q_LORA + KV_LORA + ROPE, H),
        ("q_b", 1, heads * (NOPE + ROPE), Q_LORA),
        ("W_UK^T (grouped)", heads, KV_LORA, NOPE),
        ("W_UV (grouped)", heads, V, KV_LORA),
        ("o_proj", 1, H, heads * V),
        ("dense gate+up", 1, 2 * INTER // tp, H),
        ("dense down", 1, H, INTER // tp),
        ("lm_head shard", 1, VOCAB // tp, H),
        ("drafter fc", 1, H, 6 * H // tp),  # row-parallel: its input (6 target layers' states) split
        ("drafter q+k+v", 1, (64 // tp + 2 * max(1, 8 // tp)) * 128, H),
        ("drafter o", 1, H, 64 // tp * 128),
        ("drafter gate+up", 1, 2 * INTER // tp, H),
        ("drafter gate+up, SiLU·up", 1, 2 * INTER // tp, H),  # linear_swiglu (SWIGLU below)
        ("drafter down", 1, H, INTER // tp),
    ]


SWIGLU = "SiLU·up"  # a shape so named runs torch.ops.k26.linear_swiglu (cuBLAS side: F.linear, F.silu, mul)


def floor_lib() -> ctypes.CDLL:
    """The read kernel, built with nvcc for this GPU (or a prebuilt one from $K26_FLOOR_SO)."""
    so = os.environ.get("K26_FLOOR_SO")
    lib = ctypes.CDLL(os.path.abspath(so)) if so else build_cu(FLOOR_CU, "stream_floor")
    lib.stream_read_launch.argtypes = [
        ctypes.c_void_p,
        ctypes.c_longlong,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    return lib


def chain_us(step, R: int) -> float:
    """µs per call of step(i) for i in 0..R-1, captured back to back in one graph."""
    for i in range(min(R, 2)):
        step(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(R):
            step(i)
    g.replay()
    t = events_time(g.replay)
    del g
    return t / R * 1e6


def bench_shape(name, G, N, K, ms, lib, copy_bw, sweep):
    nbytes = G * N * K * 2
    R = max(2, math.ceil(320e6 / nbytes))  # (capped at 128 until 2026-12-06: 1 MB matrices chained 134 MB)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # W_UV reads each head's second half of kv_b's rows: the same strided view the model passes.
    base = torch.randn(R, G, 2 * N if "W_UV" in name else N, K, device="cuda").to(torch.bfloat16) * K**-0.5
    ws = [(base[i, :, N:] if "W_UV" in name else base[i]) if G > 1 else base[i, 0] for i in range(R)]
    sink = torch.empty(16, dtype=torch.uint8, device="cuda")
    floors = {}
    for per_sm in (1, 4, 8):

        def rd(i, grid=per_sm * sms):  # the floor reads contiguous copies of the same size
            stream = torch.cuda.current_stream().cuda_stream  # the capture stream inside the graph
            if lib.stream_read_launch(base[i].data_ptr(), nbytes, sink.data_ptr(), grid, stream):
                raise RuntimeError("stream_read launch failed")

        floors[per_sm] = chain_us(rd, R)
    floor = min(floors.values())
    rows = []
    for M in ms:
        try:
            rows.append(bench_m(name, G, N, K, M, ws, floor, R, copy_bw, sweep))
        except RuntimeError as e:  # a launch error is not sticky: say it in the table and go on
            rows.append(
                f"| {name} | {G} x [{N}, {K}] | {nbytes / 1e6:.2f} | {M} | {floor:.2f} | failed: {e} |"
            )
            print(rows[-1], flush=True)
    return rows, floors


def bench_m(name, G, N, K, M, ws, floor, R, copy_bw, sweep) -> str:
    nbytes = G * N * K * 2
    x = torch.randn(M, G * K, device="cuda").to(torch.bfloat16)
    y = torch.empty(M, G * N, dtype=torch.bfloat16, device="cuda")
    strides = (
        G * K,
        K if G > 1 else 0,
        ws[0].stride(-2),
        ws[0].stride(0) if G > 1 else 0,
        G * N,
        N if G > 1 else 0,
    )

    swiglu = SWIGLU in name

    def k26(i, splits=None):
        if swiglu:  # tile mode only
            torch.ops.k26.linear_swiglu(x, ws[i])
        else:
            launch(x, ws[i], None, y, groups=G, strides=strides, splits=splits)

    def cublas_swiglu(i):
        gate, up = F.linear(x, ws[i]).chunk(2, dim=-1)
        return F.silu(gate) * up

    t = chain_us(k26, R)
    with pdl.disabled():  # read at capture
        t_nopdl = chain_us(k26, R)
    if swiglu:
        t_cublas = chain_us(cublas_swiglu, R)
    elif G > 1:
        x3 = x.view(M, G, K)
        t_cublas = chain_us(lambda i: torch.einsum("mgk,gnk->mgn", x3, ws[i]), R)
    else:
        t_cublas = chain_us(lambda i: F.linear(x, ws[i]), R)
    S, _ = plan_splits(M, N, K, G)
    best = ""
    if sweep and not swiglu:
        tried = {s: chain_us(lambda i, s=s: k26(i, splits=s), R) for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}
        s_best = min(tried, key=tried.get)
        best = f"{plan_splits(M, N, K, G, s_best)[0]} ({tried[s_best]:.1f})"
    gbs = nbytes / (t * 1e-6) / 1e9
    row = (
        f"| {name} | {G} x [{N}, {K}] | {nbytes / 1e6:.2f} | {M} | {floor:.2f} | {t:.2f} | "
        f"**{t / floor:.2f}** | "
        f"{t_nopdl:.2f} | {t_cublas:.2f} | {gbs:.0f} | {100 * gbs * 1e9 / copy_bw:.0f}% | {S} | "
        f"{best} |"
    )
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", default="8,1")
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--only", default="", help="comma-separated substrings of shape names")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.ops.k26.linear(*(torch.ones(1, 8, dtype=torch.bfloat16, device="cuda"),) * 2)  # build / load first
    lib = floor_lib()
    copy_bw = copy_bandwidth()
    ms = [int(m) for m in a.ms.split(",")]
    only = [s for s in a.only.split(",") if s]
    head = (
        "| projection | shape | weight MB | M | floor µs | k26 µs | x floor | k26 no PDL µs | cuBLAS µs | "
        "GB/s | % copy | splits | best splits (µs) |\n|" + "---|" * 13
    )
    dev = torch.cuda.get_device_properties(0)
    commit = source_commit()
    out = open(a.out, "w") if a.out else None  # noqa: SIM115  (rows are appended as they come: a crash keeps them)

    def emit(text: str) -> None:
        if out:
            out.write(text + "\n")
            out.flush()

    emit(
        info := f"# bench_linear — {datetime.date.today()}\n\n"
        f"- device: {dev.name} ({dev.multi_processor_count} SMs), torch {torch.__version__}\n"
        f"- commit: {commit or 'n/a'}\n"
        f"- command: `python profiling/bench_linear.py {' '.join(sys.argv[1:])}`\n"
        f"- copy ceiling measured in this run: {copy_bw / 1e12:.2f} TB/s (eager, read + write bytes)"
    )
    print(info, flush=True)
    for tp in (int(t) for t in a.tp.split(",")):
        print(f"\n### TP{tp} rank\n\n{head}", flush=True)
        emit(f"\n### TP{tp} rank\n\n{head}")
        for name, G, N, K in shapes(tp):
            if only and not any(s in name for s in only):
                continue
            for row in bench_shape(name, G, N, K, ms, lib, copy_bw, a.sweep)[0]:
                emit(row)
    if out:
        out.close()


if __name__ == "__main__":
    main()
