// The one-token (decode, M = 1) paths of the fused MoE kernel (csrc/moe_w4a16.cu launches them).
//
// gated_one_token (csrc/moe_gate_up_one_token.cuh): the gate/up rows of one routed expert for a group of one
//   token, x staged in shared memory.
// down_combine_one_token: the down projection of every routed pair (and the shared expert) of one token and
//   their weighted sum in one launch: the pairs' outputs meet in shared memory, no combine launch.
// Both reproduce the general kernels' fragments, mma order and rounding points: bit-identical results.
//
// Legality: as moe_w4a16.cu (mma.sync, ld.global, prefetch, griddepcontrol; <= 15 KB static shared memory).

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "moe_gate_up_one_token.cuh"
#include "moe_mma.cuh"
#include "pdl.cuh"

#ifndef MOE_TRACE  // phase stamps: csrc/moe_w4a16.cu defines it (-DK26_MOE_TRACE)
#define MOE_TRACE(table, k)
#endif

namespace k26_moe {

// down_combine_one_token: one block per 16-row tile of the output (D / 16 blocks) and one warp per routed pair
// (direct routing: pair k's expert is ids[k]; warp kDownOneTokPairs: the shared expert, slot topk of act),
// each over all of K = I with its chunks in flight at once, like the general down GEMM; the pairs' bf16
// outputs meet in shared memory and 16 threads write out = bf16( bf16(sum_k w_k y_k) + y_shared ) in k
// order, as combine_kernel: no y round trip through global memory and no combine launch.
constexpr int kDownOneTokPairs = 8;  // topk <= 8
constexpr int kDownOneTokThreads = 32 * (kDownOneTokPairs + 1);
constexpr int kDownOneTokU = 4;  // chunks in flight per warp, as the general down GEMM

// The one-token down kernels' tail: each warp's column 0 (the token: rows g and g + 8 of the tile, y0 and y8)
// rounded as y is stored, then the first 16 threads' weighted sum over the live pairs (plus the shared
// expert's row, after the routed sum's rounding) written once: deterministic, no atomics.
__device__ __forceinline__ void one_token_combine(float (*ys)[16], const float* weight, const int* live, int topk,
                                                  bool shared, float y0, float y8, int tile,
                                                  __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  if (t == 0) {
    ys[warp][g] = bf16_round(y0);
    ys[warp][g + 8] = bf16_round(y8);
  }
  MOE_TRACE(1, 2);
  __syncthreads();
  if (threadIdx.x >= 16) return;
  const int r = threadIdx.x;
  float sum = 0.f;
  for (int k = 0; k < topk; ++k)
    if (live[k]) sum += weight[k] * ys[k][r];
  if (shared) sum = bf16_round(sum) + ys[kDownOneTokPairs][r];
  out[(size_t)tile * 16 + r] = __float2bfloat16(sum);
  MOE_TRACE(1, 3);
}

// Warp `warp`'s routed expert in a one-token down + combine block (-1: the shared warp, or an id outside [0, E)):
// the router's ids and weights, complete before the gate/up GEMM's routed blocks let the grid launch, read once
// (coherently); lane 0 records the pair's liveness and weight for the combine, which reads them from shared memory.
__device__ __forceinline__ int pair_expert(const int64_t* __restrict__ ids, const float* __restrict__ topw, int topk,
                                           int E, bool shared, int warp, int lane, int* live, float* weight) {
  int e = -1;
  float wgt = 0.f;
  if (!shared && warp < topk) {
    const int64_t id = __ldcg(ids + warp);
    if (id >= 0 && id < E) e = (int)id, wgt = __ldcg(topw + warp);
  }
  if (!shared && lane == 0) live[warp] = e >= 0, weight[warp] = wgt;
  return e;
}

static __global__ void __launch_bounds__(kDownOneTokThreads) down_combine_one_token(
    const __nv_bfloat16* __restrict__ act, const uint4* __restrict__ w2, const uint32_t* __restrict__ s2, int I,
    int n_tiles, const int64_t* __restrict__ ids, const float* __restrict__ topw, int topk, int E,
    const __nv_bfloat16* __restrict__ sd, __nv_bfloat16* __restrict__ out) {
  __shared__ float ys[kDownOneTokPairs + 1][16];
  __shared__ float weight[kDownOneTokPairs];  // pair k's combine weight, 0 unless live[k]
  __shared__ int live[kDownOneTokPairs];      // pair k's id is in [0, E)
  MOE_TRACE(1, 0);
  pdl_trigger();  // the next kernel waits for us before reading out
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, KC = I >> 6;
  const bool shared = warp == kDownOneTokPairs;
  const int e = pair_expert(ids, topw, topk, E, shared, warp, lane, live, weight);
  const bool busy = shared ? sd != nullptr : e >= 0;
  const size_t base = ((size_t)max(e, 0) * n_tiles + tile) * KC;
  if (busy && !shared)  // the pair's weights into L2 while the gate/up GEMM finishes
    for (int c = 0; c < KC; ++c) {
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(w2 + (base + c) * 32 + lane));
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(s2 + (base + c) * 16));
    }
  pdl_wait();  // act comes from the gate/up GEMM
  MOE_TRACE(1, 1);
  float acc[1][1][4] = {{{0.f, 0.f, 0.f, 0.f}}};
  // Activation row of this warp's slot in column g = 0 (the token); other columns are zero padding.
  const int slot = shared ? topk : warp;
  const uint4* brow[1] = {g == 0 ? reinterpret_cast<const uint4*>(act + (size_t)slot * I) + 2 * t : nullptr};
  if (busy && shared) {
    shared_acc<1, 1, false>(sd, nullptr, I, tile, 0, KC, brow, acc);
  } else if (busy) {
    for (int c0 = 0; c0 < KC; c0 += kDownOneTokU) {
      uint4 wv[kDownOneTokU], bv[kDownOneTokU][2];
      uint32_t sv[kDownOneTokU];
#pragma unroll
      for (int u = 0; u < kDownOneTokU; ++u)
        if (c0 + u < KC) {
          wv[u] = ld_weight(w2 + (base + c0 + u) * 32 + lane);
          sv[u] = __ldg(s2 + (base + c0 + u) * 16 + 2 * g + (t >> 1));
#pragma unroll
          for (int q = 0; q < 2; ++q)  // act, the gate/up's output: coherent (pdl.cuh)
            bv[u][q] = brow[0] ? ld_act(brow[0] + (c0 + u) * 8 + q) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int u = 0; u < kDownOneTokU; ++u) {
        if (c0 + u >= KC) break;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t word = j == 0 ? wv[u].x : j == 1 ? wv[u].y : j == 2 ? wv[u].z : wv[u].w;
          uint32_t a[4];
          dequant(word, sv[u], a);
          const uint4 b = bv[u][j >> 1];
          mma_bf16(acc[0][0], a, (j & 1) ? b.z : b.x, (j & 1) ? b.w : b.y);
        }
      }
    }
  }
  one_token_combine(ys, weight, live, topk, sd != nullptr, acc[0][0][0], acc[0][0][2], tile, out);
}

// down_combine_one_token_staged (I <= 256: K2.6 at TP8; csrc/moe_w4a16.cu launches it in place of the kernel
// above; measured 2026-12-05 on an H200: the MoE block at one token 25.0 -> 23.8 µs, TP8-rank shapes,
// profiling/results/2026-12-05-variants-session20-h200.md): the block's weights, every routed pair's int4 chunks and scales and the shared expert's bf16 rows
// (31 KB), are copied into shared memory with cp.async BEFORE the grid-dependency wait: they are constants,
// known once the ids are. After the wait a warp copies its act row (one 16-byte cp.async a lane, L2) and
// multiplies from shared memory: no DRAM round trip after the wait (the kernel above: its routed weights one
// L2 round trip, the shared expert's bf16 rows two DRAM ones). Nothing held in registers across the wait,
// so <= 56 registers: 4 blocks per SM on sm_90 (all 448 blocks in one wave; above: 3, 396 slots), 3 on
// sm_120 (shared memory; 188 SMs). Same fragments and mma order as the kernel above: bit-identical.
// Legality: cp.async (sm_80+), mma.sync, griddepcontrol; 31.1 KB static shared memory.
constexpr int kDownStageChunks = 4;  // I <= 64 * 4

__device__ __forceinline__ void moe_cp_async16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void moe_cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

static __global__ void __launch_bounds__(kDownOneTokThreads, 4) down_combine_one_token_staged(
    const __nv_bfloat16* __restrict__ act, const uint4* __restrict__ w2, const uint32_t* __restrict__ s2, int I,
    int n_tiles, const int64_t* __restrict__ ids, const float* __restrict__ topw, int topk, int E,
    const __nv_bfloat16* __restrict__ sd, __nv_bfloat16* __restrict__ out) {
  constexpr int C = kDownStageChunks;
  __shared__ uint4 ws[kDownOneTokPairs][C][32];  // routed pair k's chunks, lane-major as in global memory
  __shared__ uint4 ss[kDownOneTokPairs][C][4];   // their scales: 16 words a chunk
  __shared__ uint4 sh[C][4][32];                 // shared expert: [chunk][row g q0, q1, row g + 8 q0, q1][lane]
  __shared__ uint4 xa[kDownOneTokPairs + 1][C * 8];  // warp w's act row (the shared warp's: slot topk)
  __shared__ float ys[kDownOneTokPairs + 1][16];
  __shared__ float weight[kDownOneTokPairs];
  __shared__ int live[kDownOneTokPairs];
  MOE_TRACE(1, 0);
  pdl_trigger();  // the next kernel waits for us before reading out
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, KC = I >> 6;
  const bool shared = warp == kDownOneTokPairs;
  const int e = pair_expert(ids, topw, topk, E, shared, warp, lane, live, weight);
  const bool busy = shared ? sd != nullptr : e >= 0;
  const size_t base = ((size_t)max(e, 0) * n_tiles + tile) * KC;
  if (busy && !shared) {  // the pair's weights into shared memory while the gate/up GEMM finishes
    for (int c = 0; c < KC; ++c) moe_cp_async16(&ws[warp][c][lane], w2 + (base + c) * 32 + lane);
    if (lane < 4 * KC) moe_cp_async16(&ss[warp][lane >> 2][lane & 3], s2 + (base + (lane >> 2)) * 16 + 4 * (lane & 3));
  } else if (busy) {  // rows tile * 16 + g and + 8 of the shared expert's bf16 down [D, I] (shared_acc's)
    const size_t row = (size_t)tile * 16 + g;
    const uint4* ra = reinterpret_cast<const uint4*>(sd + row * I) + 2 * t;
    const uint4* rb = reinterpret_cast<const uint4*>(sd + (row + 8) * I) + 2 * t;
    for (int c = 0; c < KC; ++c)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        moe_cp_async16(&sh[c][q][lane], ra + c * 8 + q);
        moe_cp_async16(&sh[c][2 + q][lane], rb + c * 8 + q);
      }
  }
  pdl_wait();  // act comes from the gate/up GEMM
  MOE_TRACE(1, 1);
  const int slot = shared ? topk : warp;
  if (busy && lane < KC * 8) moe_cp_async16(&xa[warp][lane], reinterpret_cast<const uint4*>(act + (size_t)slot * I) + lane);
  moe_cp_async_wait_all();
  __syncwarp();  // a warp reads only what its own lanes copied
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  if (busy) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (c >= KC) break;
      // B: act of column g = 0 (the token), as the kernel above's brow loads; other columns zero
      const uint4 bq[2] = {g == 0 ? xa[warp][c * 8 + 2 * t] : zero, g == 0 ? xa[warp][c * 8 + 2 * t + 1] : zero};
      if (shared) {  // shared_acc<1, 1, false>'s fragments and order
        const uint4 A[2] = {sh[c][0][lane], sh[c][1][lane]}, B[2] = {sh[c][2][lane], sh[c][3][lane]};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4 &a4 = A[j >> 1], &b4 = B[j >> 1], &b = bq[j >> 1];
          const uint32_t a[4] = {(j & 1) ? a4.z : a4.x, (j & 1) ? b4.z : b4.x, (j & 1) ? a4.w : a4.y,
                                 (j & 1) ? b4.w : b4.y};
          mma_bf16(acc, a, (j & 1) ? b.z : b.x, (j & 1) ? b.w : b.y);
        }
      } else {
        const uint4 wv = ws[warp][c][lane];
        const uint32_t sv = reinterpret_cast<const uint32_t*>(&ss[warp][c][0])[2 * g + (t >> 1)];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t word = j == 0 ? wv.x : j == 1 ? wv.y : j == 2 ? wv.z : wv.w;
          uint32_t a[4];
          dequant(word, sv, a);
          const uint4& b = bq[j >> 1];
          mma_bf16(acc, a, (j & 1) ? b.z : b.x, (j & 1) ? b.w : b.y);
        }
      }
    }
  }
  one_token_combine(ys, weight, live, topk, sd != nullptr, acc[0], acc[2], tile, out);
}

}  // namespace k26_moe
