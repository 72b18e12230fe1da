"""How much faster a dense projection runs when its weight is already in L2: the question behind letting a
latency-bound kernel (the MLA attention's barrier + merge, ~5 µs of an idle memory system a layer) prefetch
the next projection's weight. Each case is one graph replay of [256 MB read (cold L2; `--flush write` leaves
dirty lines the projection's reads then write back), warm-up, a ~10 µs spin (prefetches land), projection];
the projection kernel's own duration comes from torch.profiler (CUPTI reports the kernels of a replay), median
over the replays. Warm-ups: none; `prefetch.global.L2` every 128 B / every 32 B of the weight (is a prefetch a
whole line or a sector?); `cp.async.bulk.prefetch.L2` of 16 KB chunks; a full read (16-byte loads).

    python profiling/debug/l2_hot_probe.py [--reps 40]
"""

import argparse
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from timing import build_cu, capture

import k26.ops  # noqa: F401  (registers torch.ops.k26.*)

WARM_CU = r"""
#include <cuda_runtime.h>
#include <stdint.h>
__global__ void prefetch_l2(const char* p, long long bytes, int stride) {
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * stride; i < bytes;
       i += (long long)gridDim.x * blockDim.x * stride)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
}
__global__ void bulk_prefetch_l2(const char* p, long long bytes, int chunk) {
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * chunk; i < bytes;
       i += (long long)gridDim.x * blockDim.x * chunk) {
    const int n = (int)min((long long)chunk, bytes - i);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + i), "r"(n) : "memory");
  }
}
__global__ void read_all(const uint4* p, long long n, uint4* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint4 v = p[i];
    acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = acc;
}
extern "C" int warm(const void* p, long long bytes, int mode, int blocks, void* sink, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (mode == 1 || mode == 2)
    prefetch_l2<<<blocks, 256, 0, st>>>((const char*)p, bytes, mode == 1 ? 128 : 32);
  else if (mode == 4)
    bulk_prefetch_l2<<<blocks, 32, 0, st>>>((const char*)p, bytes, 16384);
  else if (mode == 3)
    read_all<<<blocks, 256, 0, st>>>((const uint4*)p, bytes / 16, (uint4*)sink);
  return (int)cudaGetLastError();
}
"""

MODES = {
    0: "cold (no warm-up)",
    1: "prefetch.L2 / 128 B",
    2: "prefetch.L2 / 32 B",
    4: "bulk prefetch.L2 / 16 KB",
    3: "full read",
}


def kernel_times(graph: torch.cuda.CUDAGraph, reps: int, match: str) -> tuple[float, float]:
    """Median device µs of the kernels whose name holds `match`, and of the warm-up kernel, over `reps`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    proj, warm = [], []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        if match in e.name:
            proj.append(e.time_range.elapsed_us())
        elif "prefetch_l2" in e.name or "read_all" in e.name:  # (bulk_prefetch_l2 too)
            warm.append(e.time_range.elapsed_us())
    return statistics.median(proj), statistics.median(warm) if warm else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--flush", choices=("read", "write"), default="read")
    a = ap.parse_args()
    dev = torch.device("cuda")
    lib = build_cu(WARM_CU, "l2_hot_probe")
    lib.warm.argtypes = [
        ctypes.c_void_p,
        ctypes.c_longlong,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    sink = torch.empty(16, dtype=torch.uint8, device=dev)
    l2_mb = torch.cuda.get_device_properties(dev).L2_cache_size >> 20
    print(f"device: {torch.cuda.get_device_name(dev)} ({sms} SMs), L2 {l2_mb} MB")
    print(
        "| projection | weight MB | M | "
        + " | ".join(f"{MODES[m]} µs" for m in MODES)
        + " | warm-up kernel µs (128 B / 32 B / bulk / read) |"
    )
    print("|---|---|---|" + "---|" * (len(MODES) + 1))
    for name, n, k in (
        ("o_proj", 7168, 1024),
        ("q_a+kv_a", 2112, 7168),
        ("q_b", 1536, 1536),
        ("router-sized", 384, 7168),
    ):
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k**0.5
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            row, warms = [], []
            for mode in MODES:

                def step(mode=mode, x=x, w=w):
                    flush.fill_(1) if a.flush == "write" else flush.max()
                    if mode:
                        st = torch.cuda.current_stream().cuda_stream
                        assert lib.warm(w.data_ptr(), w.numel() * 2, mode, sms * 4, sink.data_ptr(), st) == 0
                    torch.cuda._sleep(20_000)
                    return torch.ops.k26.linear(x, w)

                step()
                g = capture(step)
                t, tw = kernel_times(g, a.reps, "linear")
                row.append(f"{t:.2f}")
                if mode:
                    warms.append(f"{tw:.2f}")
            print(
                f"| {name} | {w.numel() * 2 / 1e6:.2f} | {m} | "
                + " | ".join(row)
                + f" | {' / '.join(warms)} |"
            )


if __name__ == "__main__":
    main()
