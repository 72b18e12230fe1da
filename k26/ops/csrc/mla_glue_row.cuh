// One token's MLA glue on a block of 256 threads (csrc/mla_glue.cu's kernel): the launch parameters, the RMSNorm
// rounding points and `glue_token` (both norms, k_pe's RoPE, the latent-cache write). The arithmetic and its
// reasons: csrc/mla_glue.cu's header.
//
// Legality: plain loads / stores, cp.async, shuffles and griddepcontrol only: sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "rope.cuh"

namespace k26_glue {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kMaxChunks = 2;  // chunks of 8 values per thread: Q + R <= 4096

struct GlueParams {
  const __nv_bfloat16* q;     // [T, Q] rows q_ld apart
  const __nv_bfloat16* kv;    // [T, R + P] rows kv_ld apart
  const __nv_bfloat16* q_w;   // [Q]
  const __nv_bfloat16* kv_w;  // [R]
  const long long* pos;       // [T]
  const float* inv_freq;      // [P / 2]
  const long long* rows;      // [B]
  const long long* prefix;    // [B]
  __nv_bfloat16* q_out;       // [T, Q] contiguous
  __nv_bfloat16* cache;       // [rows, len, R + P]: row stride c_row, token stride c_tok, contiguous last dim
  long long q_ld, kv_ld, c_row, c_tok;
  int N, Q, R, P;
  float eps;
};

__device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x, f[2 * i + 1] = p.y;
  }
}

// bf16(w * bf16(x * rs)): RMSNorm's two rounding points.
__device__ __forceinline__ uint4 normed(const float (&f)[8], const uint4& w, float rs) {
  float wf[8];
  unpack(w, wf);
  uint4 out;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float a = __bfloat162float(__float2bfloat16(__fmul_rn(f[2 * i], rs)));
    const float b = __bfloat162float(__float2bfloat16(__fmul_rn(f[2 * i + 1], rs)));
    h[i] = __floats2bfloat162_rn(__fmul_rn(wf[2 * i], a), __fmul_rn(wf[2 * i + 1], b));
  }
  return out;
}

// The glue of token t, by all 256 threads of the block.
__device__ __forceinline__ void glue_token(const GlueParams& p, int t) {
  const int b = t / p.N, n = t % p.N;
  const int qc = p.Q / 8, chunks = qc + p.R / 8;

  // Weights first: they do not depend on the previous kernel.
  uint4 w[kMaxChunks];
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (c < qc) {
      w[i] = reinterpret_cast<const uint4*>(p.q_w)[c];
    } else if (c < chunks) {
      w[i] = reinterpret_cast<const uint4*>(p.kv_w)[c - qc];
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // q_a / kv_a come from the projection just before
  cudaTriggerProgrammaticLaunchCompletion();
#endif

  float x[kMaxChunks][8];
  float ss_q = 0.f, ss_kv = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (c >= chunks) continue;
    const __nv_bfloat16* src = c < qc ? p.q + t * p.q_ld + 8 * c : p.kv + t * p.kv_ld + 8 * (c - qc);
    unpack(*reinterpret_cast<const uint4*>(src), x[i]);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s = __fmaf_rn(x[i][j], x[i][j], s);
    (c < qc ? ss_q : ss_kv) += s;
  }
  __shared__ float2 part[kWarps];
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    ss_q += __shfl_xor_sync(0xffffffffu, ss_q, o);
    ss_kv += __shfl_xor_sync(0xffffffffu, ss_kv, o);
  }
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = make_float2(ss_q, ss_kv);
  __syncthreads();
  float2 tot = make_float2(0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kWarps; ++i) tot.x += part[i].x, tot.y += part[i].y;
  // torch's mean is the sum times fp32(1 / width). (Q = 0, the kv half alone for csrc/mla_glue_linear.cu: rs_q is
  // NaN and unused.)
  const float rs_q = rsqrtf(__fadd_rn(__fmul_rn(tot.x, 1.f / (float)p.Q), p.eps));
  const float rs_kv = rsqrtf(__fadd_rn(__fmul_rn(tot.y, 1.f / (float)p.R), p.eps));

  __nv_bfloat16* dst = p.cache + p.rows[b] * p.c_row + (p.prefix[b] + n) * p.c_tok;
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (c >= chunks) continue;
    if (c < qc) {
      reinterpret_cast<uint4*>(p.q_out + (long long)t * p.Q)[c] = normed(x[i], w[i], rs_q);
    } else {
      reinterpret_cast<uint4*>(dst)[c - qc] = normed(x[i], w[i], rs_kv);
    }
  }
  // Interleaved rotary pairs (2i, 2i + 1) of k_pe, angle = fp32(position) * inv_freq[i] in fp32.
  const int i = threadIdx.x;
  if (i < p.P / 2) {
    const __nv_bfloat162 v = reinterpret_cast<const __nv_bfloat162*>(p.kv + t * p.kv_ld + p.R)[i];
    reinterpret_cast<__nv_bfloat162*>(dst + p.R)[i] = k26_rope_pair(v, p.pos[t], p.inv_freq[i]);
  }
}

constexpr int kMaxRows = 16;  // tokens a glue_q_rows call serves

// This thread's chunks of the q norm weight for glue_q_rows (weights: readable before the grid-dependency wait).
__device__ __forceinline__ void load_q_weight(const GlueParams& p, uint4 (&qw)[kMaxChunks]) {
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (c < p.Q / 8) qw[i] = reinterpret_cast<const uint4*>(p.q_w)[c];
  }
}
// The q half of the glue for tokens t0 .. t0 + M - 1 (M <= ROWS <= kMaxRows) into shared memory, rows ldx apart,
// by all 256 threads of a block: glue_token's arithmetic and reduction order (chunk c on thread c % 256, the same
// per-thread sums, shuffles and warp-order total), so the rows are bit for bit its q_out. qw: load_q_weight's.
// The loops unroll over ROWS, so the rows' shuffles and rewrites interleave. Ends with a block barrier.
template <int ROWS>
__device__ __forceinline__ void glue_q_rows(const GlueParams& p, int t0, int M, const uint4 (&qw)[kMaxChunks],
                                            __nv_bfloat16* xs, int ldx) {
  static_assert(ROWS <= kMaxRows, "rows of one launch");
  __shared__ float part[ROWS][kWarps];
  const int qc = p.Q / 8;
  // Every raw row's chunks in flight at once (cp.async; a thread reads back only its own chunks, so its wait
  // is the only ordering needed): a row at a time, the M L2 round trips were serial (N = 16 verify slower).
#pragma unroll
  for (int m = 0; m < ROWS; ++m)
#pragma unroll
    for (int i = 0; i < kMaxChunks; ++i) {
      const int c = threadIdx.x + i * kThreads;
      if (m >= M || c >= qc) continue;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(xs + m * ldx + 8 * c));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst),
                   "l"(p.q + (long long)(t0 + m) * p.q_ld + 8 * c));
    }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  float ss[ROWS];  // each thread's sum of squares of a row as glue_token forms it, then its warp's
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    ss[m] = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxChunks; ++i) {
      const int c = threadIdx.x + i * kThreads;
      if (m >= M || c >= qc) continue;
      float x[8], s = 0.f;
      unpack(*reinterpret_cast<const uint4*>(xs + m * ldx + 8 * c), x);
#pragma unroll
      for (int j = 0; j < 8; ++j) s = __fmaf_rn(x[j], x[j], s);
      ss[m] += s;
    }
  }
#pragma unroll
  for (int o = 16; o; o >>= 1)
#pragma unroll
    for (int m = 0; m < ROWS; ++m) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], o);
  if (threadIdx.x % 32 == 0)
#pragma unroll
    for (int m = 0; m < ROWS; ++m) part[m][threadIdx.x / 32] = ss[m];
  __syncthreads();
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {  // normed in place: each thread rewrites its own chunks
    if (m >= M) break;
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) tot += part[m][w];
    const float rs = rsqrtf(__fadd_rn(__fmul_rn(tot, 1.f / (float)p.Q), p.eps));
#pragma unroll
    for (int i = 0; i < kMaxChunks; ++i) {
      const int c = threadIdx.x + i * kThreads;
      if (c >= qc) continue;
      uint4* at = reinterpret_cast<uint4*>(xs + m * ldx + 8 * c);
      float x[8];
      unpack(*at, x);
      *at = normed(x, qw[i], rs);
    }
  }
  __syncthreads();
}

}  // namespace k26_glue
