// Dynamic shared memory above 48 KB for a kernel, opted into once per device: an attribute set in one
// device's context does not carry to another's (one process may drive several GPUs: tests, benchmarks).
//
//   if (cudaError_t e = smem_opt_in<kernel_a, kernel_b>(bytes); e != cudaSuccess) return e;
//
// Host code only (cudaFuncSetAttribute): legal for every architecture the kernels are built for.

#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

template <auto... Kernels>
cudaError_t smem_opt_in(int bytes) {
  static uint64_t done = 0;  // bit d: set on device d (< 64); one mask per kernel list
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 64 && (done >> dev & 1)) return cudaSuccess;
  ((e = e == cudaSuccess ? cudaFuncSetAttribute(Kernels, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) : e),
   ...);
  if (e == cudaSuccess && dev < 64) done |= uint64_t(1) << dev;
  return e;
}
