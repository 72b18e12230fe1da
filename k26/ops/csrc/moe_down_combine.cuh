// The MoE kernel's weighted combine of the pairs' expert outputs (csrc/moe_w4a16.cu launches these):
// combine_kernel after the down GEMM (any M), and down_combine_grouped, which also runs the down projection.
//
// down_combine_grouped: the MoE kernel's down projection and weighted combine of a few tokens (1 < M, at most
// kDownCombineMaxSlots routed + shared slots, I <= 64 kDownCombineMaxChunks) in one launch over the routing
// table (csrc/moe_route.cuh), in place of the down GEMM (one block per (group, 128 output rows): a grid of the
// table's bound on groups, mostly empty blocks when tokens share experts, in several waves) and the combine.
//
// One block per RT 16-row output tiles (D / (16 RT) blocks: one wave on an H200, and on an RTX PRO 6000 while
// two blocks fit its 100 KB an SM — K2.6's largest case, 64 tokens with the shared expert, leaves ~0.9 KB; with
// more experts or slots it runs two waves, only slower), over the
// nt = 1 table (groups of <= 8 tokens); its 8 warps share the table's groups, each with all of K = I of its RT
// tiles in flight: the shared expert's groups (first in the table, from their bf16 rows) by warps 0, 1, ..., the
// routed ones dealt so those warps take theirs last (routed_at below: the verify N = 16 step 6.90 -> 6.87 ms,
// 2026-12-04-moe-down-deal-session17-h200.md). Every pair's bf16 output (the reference's per-expert rounding point) meets in shared memory,
// then the block writes out[t] = bf16( bf16(sum_k w[t,k] y[t,k]) + y_shared[t] ) for its rows in k order, as
// combine_kernel does.
// Same fragments, the same mma order per output element and the same rounding points as the down GEMM +
// combine: bit-identical to them (tests/test_moe_gpu.py).
//
// PDL: the table, ids and weights are complete when this grid launches (the gate/up GEMM's routed blocks
// let it launch only after their own wait for the routing), so the block reads them and issues its first
// weight batch before the grid-dependency wait; act (the gate/up GEMM's output) is read after it.
//
// Legality: as moe_w4a16.cu (mma.sync, plain loads, griddepcontrol); dynamic shared memory down_combine_smem:
// 47.6 KB at K2.6's largest case (M = 64 with the shared expert; 52 KB with the block's own table, `own`),
// <= 56 KB for any E the own table takes (<= 512; sm_120: 99 KB).

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "moe_mma.cuh"
#include "moe_route.cuh"
#include "pdl.cuh"

#ifndef MOE_TRACE  // phase stamps: csrc/moe_w4a16.cu defines it (-DK26_MOE_TRACE)
#define MOE_TRACE(table, k)
#endif

namespace k26_moe {

constexpr int kDownCombineMaxSlots = 576;  // P + S: 64 tokens at top-8 plus their 64 shared-expert slots
constexpr int kDownCombineWarps = 8;
constexpr int kDownCombineRT = 2;  // 16-row output tiles per block (and per warp: their B fragments shared)
// K = I in 64-wide chunks at most: a group's whole K in flight at once (K2.6 at TP8: I = 256). Wider experts
// (TP1's 2048) stream K in batches per group, latency-bound here: measured slower than the down GEMM
// (2026-12-02-bench_moe-down-combine-h200.md), so they keep it.
constexpr int kDownCombineMaxChunks = 4;

// Dynamic shared memory of one block: y [P + S][16 RT] bf16 | sorted [P + S] | group fields [3][G] |
// combine weights [P] (0 for an id outside [0, E)) | their validity [P] | with `own` (the block builds the table
// itself): build_route_table's scratch [3 E].
__host__ __device__ inline size_t down_combine_smem(int P, int S, int G, int E, bool own) {
  return (size_t)(P + S) * 16 * kDownCombineRT * 2 + (size_t)(P + S) * 4 + (size_t)3 * G * 4 + (size_t)P * 8 +
         (own ? (size_t)3 * E * 4 : 0);
}

// One 8-token column tile per group (nt = 1: the routing table's groups hold <= 8 tokens).
static __global__ void __launch_bounds__(32 * kDownCombineWarps, 2) down_combine_grouped(
    const __nv_bfloat16* __restrict__ act, const uint4* __restrict__ w2, const uint32_t* __restrict__ s2, int I,
    int n_tiles, RouteTable tab, int G, const int64_t* __restrict__ ids, const float* __restrict__ topw, int M,
    int topk, int E, int S, const __nv_bfloat16* __restrict__ sd, __nv_bfloat16* __restrict__ out, int own) {
  constexpr int RT = kDownCombineRT, ROWS = 16 * RT;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const int P = M * topk, SG = (S + 7) / 8;  // SG: the shared expert's groups, first in the table
  __nv_bfloat16* ys = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [P + S][ROWS]
  int* s_sorted = reinterpret_cast<int*>(ys + (size_t)(P + S) * ROWS);
  int* s_expert = s_sorted + P + S;
  int* s_start = s_expert + G;
  int* s_len = s_start + G;
  float* s_w = reinterpret_cast<float*>(s_len + G);
  int* s_live = reinterpret_cast<int*>(s_w + P);
  MOE_TRACE(1, 0);
  pdl_trigger();  // the next kernel waits for our completion before reading out
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int tile0 = blockIdx.x * RT, KC = I >> 6;
  // The routing (complete at launch, see above) into shared memory: one round trip for every field, or (own:
  // the gate/up GEMM grouped the pairs from the ids, group_from_ids, and wrote act by pair) the table built here
  // from the ids, off the critical path (this grid waits for the gate/up GEMM anyway). Which group computes a
  // pair changes no bit: every column of an mma is its own token.
  int ng;
  if (own) {
    __shared__ int s_ng;
    build_route_table([&](int p) { return __ldcg(ids + p); }, P, E, 8, S,
                      RouteTable{&s_ng, s_sorted, s_expert, s_start, s_len}, s_live + P);
    __syncthreads();
    ng = min(s_ng, G);
  } else {
    ng = min(__ldcg(tab.num_groups), G);
    for (int i = tid; i < P + S; i += blockDim.x) s_sorted[i] = __ldcg(tab.sorted + i);
    for (int i = tid; i < ng; i += blockDim.x)
      s_expert[i] = __ldcg(tab.expert + i), s_start[i] = __ldcg(tab.start + i), s_len[i] = __ldcg(tab.len + i);
  }
  for (int i = tid; i < P; i += blockDim.x) {
    const int64_t e = __ldcg(ids + i);
    const bool live = e >= 0 && e < E;
    s_live[i] = live, s_w[i] = live ? __ldcg(topw + i) : 0.f;  // the router's: coherent (pdl.cuh)
  }
  __syncthreads();

  // This warp's groups: warp, warp + 8, ... (the shared expert's first, then routed ones).
  const uint4* brow[1];
  float acc[RT][1][4];
  auto begin_group = [&](int gi) {  // act row of column g's token (nullptr: padding), zeroed accumulators
    const int st = s_start[gi], ln = s_len[gi];
    const int row = g < ln ? (own ? s_sorted[st + g] : st + g) : 0;  // act by pair (own) or by table slot
    brow[0] = g < ln ? reinterpret_cast<const uint4*>(act + (size_t)row * I) + 2 * t : nullptr;
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][0][i] = 0.f;
  };
  auto store_group = [&](int gi, bool shared) {  // bf16 outputs (the reference's rounding point) -> ys[pair]
    const int st = s_start[gi], ln = s_len[gi];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // token columns 2t and 2t + 1; rows g and g + 8 of each tile
      const int n = 2 * t + h;
      if (n >= ln) continue;
      __nv_bfloat16* y = ys + (size_t)(shared ? st + n : s_sorted[st + n]) * ROWS;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        y[r * 16 + g] = __float2bfloat16(acc[r][0][h]);
        y[r * 16 + g + 8] = __float2bfloat16(acc[r][0][2 + h]);
      }
    }
  };

  int gi = warp;
  if (gi < SG) pdl_wait();  // act comes from the gate/up GEMM
  MOE_TRACE(1, 5);
  for (; gi < ng && gi < SG; gi += kDownCombineWarps) {
    begin_group(gi);
    shared_acc<RT, 1, false>(sd, nullptr, I, tile0, 0, KC, brow, acc);
    store_group(gi, true);
  }
  MOE_TRACE(1, 6);
  // Routed groups: all of a group's K in one batch, the next group's batch in flight while this one's outputs
  // are stored. Dealt so the shared expert's warps take theirs last: its bf16 group costs them ~kSharedCost
  // routed groups after the wait, so the other warps first take kSharedCost rounds of routed groups each,
  // then all warps deal the rest round-robin (plain round-robin left warps 0 / 1 the block's last by ~2 routed
  // groups at M = 16, 25 experts: moe_trace.py). Which warp computes a group changes no bit. kSharedCost 1 and 3
  // measured no better (verify N = 16 6.85 / 6.84 vs 6.82 ms, 2026-12-04-moe-gate-up-session18-h200.md).
  constexpr int kSharedCost = 2;
  const int R = max(ng - SG, 0), W2 = kDownCombineWarps - min(SG, kDownCombineWarps);
  const int n1 = W2 > 0 ? min(R, kSharedCost * W2) : 0;  // the first rounds, shared-expert warps left out
  const int c1 = warp >= SG && W2 > 0 ? max(0, (n1 - (warp - SG) + W2 - 1) / W2) : 0;  // of them, this warp's
  auto routed_at = [&](int k) {  // this warp's k-th routed group (0-based among the routed), or -1
    const int j = k < c1 ? warp - SG + W2 * k : n1 + warp + kDownCombineWarps * (k - c1);
    return j < R ? j : -1;
  };
  uint4 wv[kDownCombineMaxChunks][RT];
  uint32_t sv[kDownCombineMaxChunks][RT];
  auto load_w = [&](int e) {  // expert e's RT tiles over all of K (constants: any time)
#pragma unroll
    for (int c = 0; c < kDownCombineMaxChunks; ++c)
      if (c < KC)
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const size_t chunk = ((size_t)e * n_tiles + tile0 + r) * KC + c;
          wv[c][r] = ld_weight(w2 + chunk * 32 + lane);  // streamed once
          sv[c][r] = __ldg(s2 + chunk * 16 + 2 * g + (t >> 1));
        }
  };
  int j = routed_at(0);
  if (j >= 0) load_w(s_expert[SG + j]);
  if (warp >= SG) pdl_wait();  // (after the first batch: weights are constants, in flight across the wait)
  MOE_TRACE(1, 1);
  for (int k = 1; j >= 0; ++k) {
    gi = SG + j;
    begin_group(gi);
    uint4 bv[kDownCombineMaxChunks][1][2];
#pragma unroll
    for (int c = 0; c < kDownCombineMaxChunks; ++c)
#pragma unroll
      for (int q = 0; q < 2; ++q)
        bv[c][0][q] = c < KC && brow[0] ? ld_act(brow[0] + c * 8 + q) : make_uint4(0, 0, 0, 0);  // act: pdl.cuh
#pragma unroll
    for (int c = 0; c < kDownCombineMaxChunks; ++c) {
      if (c >= KC) break;
      mma_chunk<RT, 1>(wv[c], sv[c], bv[c], acc);
    }
    j = routed_at(k);
    if (j >= 0) load_w(s_expert[SG + j]);
    store_group(gi, false);
  }
  MOE_TRACE(1, 2);
  __syncthreads();
  // out[t, rows] in k order over the live pairs, then the shared expert's slot P + t (combine_kernel's sums).
  const int D = n_tiles * 16;
  for (int i = tid; i < M * ROWS; i += blockDim.x) {
    const int tok = i / ROWS, rr = i % ROWS;
    float sum = 0.f;
    for (int k = 0; k < topk; ++k) {
      const int pair = tok * topk + k;
      if (s_live[pair]) sum += s_w[pair] * __bfloat162float(ys[(size_t)pair * ROWS + rr]);
    }
    if (S) sum = bf16_round(sum) + __bfloat162float(ys[(size_t)(P + tok) * ROWS + rr]);
    out[(size_t)tok * D + tile0 * 16 + rr] = __float2bfloat16(sum);
  }
  MOE_TRACE(1, 3);
}

// combine_kernel (launch 4 of moe_w4a16.cu): out[t, d] = bf16(sum_k w[t,k] * y[t*topk + k, d]) over valid experts, k in order.
// With the shared expert: out[t] = bf16(bf16(routed sum) + y_shared[t]), the reference's two rounding points.
static __global__ void combine_kernel(const __nv_bfloat16* __restrict__ y, const float* __restrict__ topw,
                                      const int64_t* __restrict__ ids, int E, int topk, int D,
                                      __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ y_shared) {
  pdl_wait();  // y comes from the down GEMM
  const int tok = blockIdx.y;
  const int d = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (d >= D) return;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < topk; ++k) {
    const int64_t e = ids[tok * topk + k];
    if (e < 0 || e >= E) continue;
    const float wk = topw[tok * topk + k];
    const uint4 v = *reinterpret_cast<const uint4*>(y + ((size_t)tok * topk + k) * D + d);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] += wk * f.x;
      acc[2 * i + 1] += wk * f.y;
    }
  }
  if (y_shared != nullptr) {
    const uint4 v = *reinterpret_cast<const uint4*>(y_shared + (size_t)tok * D + d);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] = bf16_round(acc[2 * i]) + f.x;
      acc[2 * i + 1] = bf16_round(acc[2 * i + 1]) + f.y;
    }
  }
  uint4 o;
  __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) oh[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  *reinterpret_cast<uint4*>(out + (size_t)tok * D + d) = o;
}

}  // namespace k26_moe
