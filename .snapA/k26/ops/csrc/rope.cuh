// Interleaved-pair RoPE of one pair, bit-identical to the reference (k26/ops/reference.py: rope): angle =
// fp32(position) * inv_freq in fp32, accurate cosf / sinf, products and sums without FMA contraction
// (torch's eager x0 * cos - x1 * sin), rounded to bf16 once. Shared by the glue kernel (k_pe, csrc/mla_glue.cu)
// and the tree attention's query (q_pe, csrc/mla_tree_attn_kernel.cuh).
//
// Legality: plain fp32 arithmetic and bf16 conversions: sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

// cos and sin of one pair's angle (split from the rotation so a kernel can compute them while loads fly).
__device__ __forceinline__ float2 k26_rope_cos_sin(int64_t position, float inv_freq) {
  const float ang = __fmul_rn((float)position, inv_freq);
  return make_float2(cosf(ang), sinf(ang));
}

__device__ __forceinline__ __nv_bfloat162 k26_rope_rotate(__nv_bfloat162 v, float2 cs) {
  const float x0 = __low2float(v), x1 = __high2float(v);
  return __floats2bfloat162_rn(__fsub_rn(__fmul_rn(x0, cs.x), __fmul_rn(x1, cs.y)),
                               __fadd_rn(__fmul_rn(x0, cs.y), __fmul_rn(x1, cs.x)));
}

__device__ __forceinline__ __nv_bfloat162 k26_rope_pair(__nv_bfloat162 v, int64_t position, float inv_freq) {
  return k26_rope_rotate(v, k26_rope_cos_sin(position, inv_freq));
}
