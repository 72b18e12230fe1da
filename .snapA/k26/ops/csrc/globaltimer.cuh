// The GPU's global nanosecond clock (%globaltimer), shared by the fused all-reduce's wait timeout and the
// debug trace builds (-DK26_*_TRACE, read by profiling/debug/*_trace.py), and the host's read / reset of a
// trace table. Legality: %globaltimer is a PTX special register on every architecture (sm_90a, sm_120a).

#pragma once

#include <cuda_runtime.h>

__device__ __forceinline__ unsigned long long k26_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The SM this thread runs on (%smid): the trace builds record it to tell co-resident blocks apart.
__device__ __forceinline__ unsigned k26_smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Exported `int read_fn(void* host)` (the __device__ array `table` into host memory) and `int reset_fn()`
// (zeroes it): cudaError_t codes.
#define K26_TRACE_EXPORTS(read_fn, reset_fn, table)                                       \
  extern "C" __attribute__((visibility("default"))) int read_fn(void* host) {             \
    return (int)cudaMemcpyFromSymbol(host, table, sizeof(table));                         \
  }                                                                                       \
  extern "C" __attribute__((visibility("default"))) int reset_fn() {                      \
    static unsigned char zeros[sizeof(table)];                                            \
    return (int)cudaMemcpyToSymbol(table, zeros, sizeof(zeros));                          \
  }
