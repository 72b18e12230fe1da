"""What a kernel boundary costs on this GPU against a grid-wide barrier inside one persistent kernel: the
question behind issue 18's next step (a decode layer is a chain of 11 latency-bound kernels; a persistent
kernel would replace each boundary by a barrier or a flag).

Chain: K kernels of G blocks x 256 threads in one CUDA graph, each doing nothing but (with PDL) trigger its
dependents, wait for its predecessor, and (`dep`) have one thread read the word the previous kernel wrote and
write it + 1 — the smallest real dependency. Per kernel = replay / K (median). Persistent: one kernel of G
blocks (all resident) passing K grid barriers, with the same one-word dependency across each; per barrier =
kernel time / K; two barriers: csrc/mla_attn_merge.cuh's tile-barrier protocol (a fence, a returning atomic,
every block's thread 0 spinning on the word) and a lean one (a release reduction, acquire polls with a 20 ns
back-off). The kernel chain is a floor: empty kernels that trigger before they wait (the next grid resident
early) and end together (no drain).

    python profiling/debug/boundary_probe.py [--k 200]
"""

import argparse
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from timing import build_cu, capture

PROBE_CU = r"""
#include <cuda_runtime.h>
__global__ void link(int* word, int dep, int pdl) {
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (dep && blockIdx.x == 0 && threadIdx.x == 0) {
    const int v = *(volatile int*)word;
    *(volatile int*)word = v + 1;
  }
}
__global__ void persistent(int* bar, int* word, int phases, int lean) {
  for (int p = 0; p < phases; ++p) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {  // the dependency: one word, read and written across a barrier
      const int v = *(volatile int*)word;
      *(volatile int*)word = v + 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const int target = (p + 1) * (int)gridDim.x;
      int seen;
      if (lean) {  // a release reduction (no full fence, no value back), polls with a short back-off
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(bar) : "memory");
        for (;;) {
          asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
          if (seen >= target) break;
          __nanosleep(20);
        }
      } else {  // the tile barrier's protocol: a fence, then the arrival, every block spinning
        __threadfence();
        atomicAdd(bar, 1);
        do {
          asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
        } while (seen < target);
      }
    }
    __syncthreads();
  }
}
extern "C" int chain(int* word, int k, int grid, int dep, int pdl, void* stream) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(grid), c.blockDim = dim3(256), c.stream = (cudaStream_t)stream;
  c.attrs = attr, c.numAttrs = pdl ? 1 : 0;
  for (int i = 0; i < k; ++i)
    if (cudaLaunchKernelEx(&c, link, word, dep, pdl) != cudaSuccess) return 1;
  return (int)cudaGetLastError();
}
extern "C" int run_persistent(int* bar, int* word, int k, int grid, int lean, void* stream) {
  cudaMemsetAsync(bar, 0, sizeof(int), (cudaStream_t)stream);
  persistent<<<grid, 256, 0, (cudaStream_t)stream>>>(bar, word, k, lean);
  return (int)cudaGetLastError();
}
"""


def replay_us(graph: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=200)
    a = ap.parse_args()
    lib = build_cu(PROBE_CU, "boundary_probe")
    lib.chain.argtypes = [ctypes.c_void_p, *[ctypes.c_int] * 4, ctypes.c_void_p]
    lib.run_persistent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int] * 3, ctypes.c_void_p]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    word, bar = torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    print(f"device: {torch.cuda.get_device_name(dev)} ({sms} SMs); {a.k} kernels / barriers a graph, µs each")
    print(
        "| grid (blocks of 256) | kernel, no PDL | kernel, PDL | kernel, PDL + one-word dependency | "
        "persistent: fence + atomic + spin, + the dependency | persistent: release add + acquire polls with "
        "back-off, + the dependency |"
    )
    print("|---|---|---|---|---|---|")
    for grid in (1, sms, 2 * sms, 4 * sms):
        row = []
        for dep, pdl in ((0, 0), (0, 1), (1, 1)):
            st = lambda dep=dep, pdl=pdl, grid=grid: lib.chain(
                word.data_ptr(), a.k, grid, dep, pdl, torch.cuda.current_stream().cuda_stream
            )
            row.append(replay_us(capture(st)) / a.k)
        for lean in (0, 1):
            run = lambda grid=grid, lean=lean: lib.run_persistent(
                bar.data_ptr(), word.data_ptr(), a.k, grid, lean, torch.cuda.current_stream().cuda_stream
            )
            row.append(replay_us(capture(run)) / a.k)
        print(f"| {grid} | " + " | ".join(f"{t:.2f}" for t in row) + " |")


if __name__ == "__main__":
    main()
