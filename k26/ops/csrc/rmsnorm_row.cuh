// One row of "residual add + HF RMSNorm" on a block, the arithmetic every fused k26 norm kernel shares
// (csrc/add_rmsnorm.cu, csrc/allreduce_fused.cu): h arrives as bf16 values held in fp32, this thread's
// 16-byte vectors of the row (vector v = threadIdx.x + k * kThreads); the sum of squares runs in a fixed
// order (warp butterflies, then the warps in index order), so a row has the same bits whatever the row
// count, the grid or the rank.
//
//   res_out = h;   out = bf16( weight * bf16( h * rsqrt(mean(h^2) + eps) ) )   (k26/ops/reference.py: rms_norm)
//
// Legality: shuffles and 64 B of static shared memory only: sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace k26_norm {

constexpr int kThreads = 512;
constexpr int kMaxVec = 4;  // 16-byte vectors per thread per row: D <= 8 * kMaxVec * kThreads = 16384

struct Row {
  const __nv_bfloat16* weight;  // [D]
  __nv_bfloat16* out;           // [rows, D] normed
  __nv_bfloat16* res_out;       // [rows, D] h
  int D;
  float eps;
};

__device__ __forceinline__ void add8(float (&a)[8], uint4 v) {
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(b[j]);
    a[2 * j] += f.x;
    a[2 * j + 1] += f.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&a)[8]) {
  uint4 v;
  __nv_bfloat162* b = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) b[j] = __floats2bfloat162_rn(a[2 * j], a[2 * j + 1]);
  return v;
}

// h[j] = bf16(residual[j] + s[j]) for one vector: the reference's rounding point of the residual add.
__device__ __forceinline__ void add_residual(float (&h)[8], uint4 s, uint4 residual) {
  const __nv_bfloat16* sb = reinterpret_cast<const __nv_bfloat16*>(&s);
  const __nv_bfloat16* rb = reinterpret_cast<const __nv_bfloat16*>(&residual);
#pragma unroll
  for (int j = 0; j < 8; ++j)
    h[j] = __bfloat162float(__float2bfloat16_rn(__bfloat162float(rb[j]) + __bfloat162float(sb[j])));
}

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[kThreads / 32];
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // `part` may still be read by the previous row's sum
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) s += part[w];  // the same order in every thread and on every rank
  return s;
}

// This thread's vectors of the norm weight (a constant): loaded by the kernels before their grid-dependency
// wait, so the weight's DRAM round trip is off the row's path (loaded after the row's sum it was one more).
struct RowWeight {
  uint4 v[kMaxVec];
};

__device__ __forceinline__ RowWeight load_weight(const Row& r) {
  RowWeight w;
#pragma unroll
  for (int k = 0; k < kMaxVec; ++k) {
    const int v = threadIdx.x + k * kThreads;
    // coherent: it stays above the wait (an .nc load ptxas sinks below it: csrc/linear_tile.cuh)
    w.v[k] = v < r.D / 8 ? __ldcg(reinterpret_cast<const uint4*>(r.weight) + v) : make_uint4(0, 0, 0, 0);
  }
  return w;
}

// h (this thread's vectors of `row`) -> res_out and the normed row -> out; wt = load_weight(r).
__device__ inline void finish_row(const Row& r, int row, const float (&h)[kMaxVec][8], const RowWeight& wt) {
  const int V = r.D / 8;
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kMaxVec; ++k)
    if (threadIdx.x + k * kThreads < V)
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += h[k][j] * h[k][j];
  const float rstd = rsqrtf(block_sum(ss) / float(r.D) + r.eps);
#pragma unroll
  for (int k = 0; k < kMaxVec; ++k) {
    const int v = threadIdx.x + k * kThreads;
    if (v >= V) continue;
    const size_t at = size_t(row) * r.D + size_t(v) * 8;
    const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(&wt.v[k]);
    float y[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)  // HF order: normalise in fp32, round, then multiply by the weight and round
      y[j] = __bfloat162float(w[j]) * __bfloat162float(__float2bfloat16_rn(h[k][j] * rstd));
    *reinterpret_cast<uint4*>(r.res_out + at) = pack8(h[k]);
    *reinterpret_cast<uint4*>(r.out + at) = pack8(y);
  }
}

}  // namespace k26_norm
