// Residual add + RMSNorm in one kernel, on one GPU: what follows an all-reduce when the TP group has no fused
// one (TP 1, NCCL, a benchmark without collectives), and the decoder layer's two norms:
//
//   h = bf16( residual + x );   out = bf16( weight * bf16( h * rsqrt(mean(h^2) + eps) ) )
//
// (k26/ops/allreduce_cuda.py: add_rmsnorm_reference; the row arithmetic is csrc/rmsnorm_row.cuh, shared with
// the fused all-reduce, so both give the same bits.) One block of 512 threads per row.
//
// Why a kernel of its own: torch.compile's version is a one-block Triton reduction (2.5-3.9 µs a call in the
// compiled K2.6 step) launched without programmatic dependent launch, so the kernel after it (the router, the
// q_a / kv_a projection) could not start streaming its weights until it had finished. This one triggers its
// dependents first thing: they issue their weight loads (which depend on nothing) while it waits for its
// own inputs and normalises; they read its outputs only after their own grid-dependency wait.
//
// In the compiled K2.6 step (H200, with the tree attention under PDL and the deep small-M linear variant in the
// same A/B): decode 4.85 -> 4.72 ms, verify 16 tokens 9.02 -> 8.41 ms
// (profiling/results/2026-12-01-bench_k26-session10-h200.md).
//
// Legality: plain loads / stores, shuffles and griddepcontrol: sm_90a and sm_120a.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "pdl.cuh"
#include "rmsnorm_row.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using namespace k26_norm;

__global__ void __launch_bounds__(kThreads) add_rmsnorm_kernel(const __nv_bfloat16* x, const __nv_bfloat16* residual,
                                                              Row r) {
  pdl_trigger();  // every block is resident once all have triggered: dependents never take our SMs
  const RowWeight wt = load_weight(r);  // a constant: in flight across the wait
  pdl_wait();     // x and residual come from the kernels before
  const int row = blockIdx.x, V = r.D / 8;
  float h[kMaxVec][8];
#pragma unroll
  for (int k = 0; k < kMaxVec; ++k) {
    const int v = threadIdx.x + k * kThreads;
    if (v >= V) continue;
    const size_t at = size_t(row) * r.D + size_t(v) * 8;
    add_residual(h[k], *reinterpret_cast<const uint4*>(x + at), *reinterpret_cast<const uint4*>(residual + at));
  }
  finish_row(r, row, h, wt);
}

}  // namespace

K26_EXPORT int k26_add_rmsnorm_max_dim() { return 8 * kMaxVec * kThreads; }

// Returns a cudaError_t. The Python front door (k26/ops/allreduce_cuda.py) checks dtypes, shapes and the 16-byte
// alignment the vector loads need.
K26_EXPORT int k26_add_rmsnorm(const void* x, const void* residual, const void* weight, void* out, void* res_out,
                               int rows, int D, float eps, int pdl, void* stream) {
  if (rows < 1 || D % 8 || D > 8 * kMaxVec * kThreads) return int(cudaErrorInvalidValue);
  const Row r{static_cast<const __nv_bfloat16*>(weight), static_cast<__nv_bfloat16*>(out),
              static_cast<__nv_bfloat16*>(res_out), D, eps};
  return int(launch_pdl(add_rmsnorm_kernel, dim3(rows), dim3(kThreads), 0, pdl != 0, static_cast<cudaStream_t>(stream),
                        static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(residual), r));
}
