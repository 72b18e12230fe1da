// Interleaved-pair RoPE of one pair, bit-identical to the reference (k26/ops/reference.py: rope): angle =
// fp32(position) * inv_freq in fp32, accurate cosf / sinf, products and sums without FMA contraction
// (torch's eager x0 * cos - x1 * sin), rounded to bf16 once. Shared by the glue kernel (k_pe, csrc/mla_glue.cu)
// and the tree attention's query (q_pe, csrc/mla_tree_attn.cu).
//
// Legality: plain fp32 arithmetic and bf16 conversions: sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ __nv_bfloat162 k26_rope_pair(__nv_bfloat162 v, int64_t position, float inv_freq) {
  const float ang = __fmul_rn((float)position, inv_freq);
  const float c = cosf(ang), s = sinf(ang);
  const float x0 = __low2float(v), x1 = __high2float(v);
  return __floats2bfloat162_rn(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)),
                               __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}
