// The one-token (decode, M = 1) MoE experts in ONE launch (csrc/moe_w4a16.cu launches it when the caller
// passes `counters`): the gate/up of the routed pairs and the shared expert, then the down projections and the
// weighted sum, in one persistent grid. It replaces two launches (gemm13, down_combine_one_token) and the
// grid-completion wait between them: a down tile starts as soon as the act rows it reads are complete, not
// when the slowest gate/up block of the whole grid is.
//
// Work items, taken in this order by every block (item = blockIdx.x, + gridDim.x, ...):
//   A shared: the shared expert's 8-feature gate/up tiles, computed under the router (before the
//             grid-dependency wait), as the two-launch path's shared-expert blocks are;
//   S:        the shared expert's down, 8 output tiles an item (a warp each) -> y_shared [D] (bf16, the
//             workspace), as soon as its act row is complete (long before the routed rows are);
//   A routed: the routed pairs' gate/up tiles (after the wait: they need the router's ids);
//   B:        one 16-row output tile: warp k the down rows of pair k, then the weighted sum (+ y_shared) in
//             shared memory, as down_combine_one_token.
// A items: the 8 warps split K = D exactly as gemm13 (WK = 8) and reduce in the same order. Same fragments,
// same mma order and rounding points as the two-launch path: bit-identical results.
//
// Dependencies inside the grid: when an A item's act values (or an S warp's y_shared rows) are stored, one
// lane fences and bumps a counter (per act row; one for all of S); a waiting warp first issues its first
// weight batch, then spins (ld.acquire, every lane) until the counter is complete, then reads what it waited
// for through L2 (ld.cg: written in this launch). No deadlock: an item waits only on items of earlier kinds,
// which every block takes first, and A items wait on nothing but the previous grid; the grid is capped at
// the occupancy (queried) times the SM count, and PDL dependents launch only once every block has started.
// Counters: int32 [kOneLaunchCounters], owned by the caller (zero on allocation); the last block to leave
// zeroes them for the next launch (a later launch touches them only after its grid-dependency wait, which
// implies this grid completed).
// 8 warps, 2 blocks per SM: 128 registers (9 warps, one per B-item pair plus the shared expert, allowed
// only 96 per thread: 5 warps on one SM sub-partition's 16K registers, and spilled).
//
// Legality: mma.sync, ld.global (nc / cg / cs / acquire), atomics, nanosleep and griddepcontrol; <= 20 KB
// static shared memory per block: sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "moe_mma.cuh"
#include "moe_one_token.cuh"
#include "pdl.cuh"

namespace k26_moe {

constexpr int kOneLaunchWarps = 8;  // gemm13's K split (WK = 8) and one B warp per pair (topk <= 8)
constexpr int kOneLaunchThreads = 32 * kOneLaunchWarps;
constexpr int kOneLaunchCounters = 16;  // [0, topk]: finished tiles of each act row; then these two:
constexpr int kSharedDown = kOneLaunchCounters - 2;  // finished S tiles
constexpr int kDeparted = kOneLaunchCounters - 1;    // blocks that left

struct OneLaunch {
  const __nv_bfloat16* x;  // [1, D]
  const uint4* w13;
  const uint32_t* s13;
  const uint4* w2;
  const uint32_t* s2;
  const int64_t* ids;                 // [topk], the router's (the previous grid)
  const float* topw;                  // [topk]
  const __nv_bfloat16 *sa, *sb, *sd;  // the shared expert's gate / up [I, D] and down [D, I], or all null
  __nv_bfloat16* act;                 // [topk + 1, I]: pair k's row k, the shared expert's row topk
  __nv_bfloat16* y_shared;            // [D]: the shared expert's output
  __nv_bfloat16* out;                 // [1, D]
  int* counters;                      // [kOneLaunchCounters], zero at rest
  int D, I, E, topk;
};

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every lane of the calling warp until counter >= target (one coalesced load per poll).
__device__ __forceinline__ void wait_count(const int* counter, int target) {
  while (ld_acquire(counter) < target) __nanosleep(32);
}

// One lane per warp, after the warp's stores (ordered before it by __syncwarp): publish, then count.
__device__ __forceinline__ void count_done(int* counter) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    __threadfence();
    atomicAdd(counter, 1);
  }
}

// A item: gate/up tile `tile` of act row `row` (row topk: the shared expert). All threads of the block.
__device__ __forceinline__ void gate_up_item(const OneLaunch& p, int row, int tile, bool& waited, uint4* xs,
                                          float (*red)[4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tiles = p.I / 8, KC = p.D >> 6;
  const int c_begin = warp * KC / kOneLaunchWarps, c_end = (warp + 1) * KC / kOneLaunchWarps;
  float acc[1][1][4] = {{{0.f, 0.f, 0.f, 0.f}}};
  if (row == p.topk) {
    const uint4* brow[1] = {g == 0 ? reinterpret_cast<const uint4*>(p.x) + 2 * t : nullptr};
    shared_acc<1, 1, true>(p.sa, p.sb, p.D, tile, c_begin, c_end, brow, acc);
    if (!waited) pdl_wait(), waited = true;  // computed under the router; written only after it completed
  } else {
    if (!waited) pdl_wait(), waited = true;  // the ids come from the router
    const int64_t id = __ldcg(p.ids + row);  // block-uniform
    if (id < 0 || id >= p.E) return;         // dropped: its B warp never waits for this row
    gated_one_token(p.w13, p.s13, p.x, p.D, ((size_t)id * tiles + tile) * KC, c_begin, c_end, xs, acc[0][0]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) red[warp][i][lane] = acc[0][0][i];
  __syncthreads();
  if (warp == 0) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = 0.f;
#pragma unroll
      for (int q = 0; q < kOneLaunchWarps; ++q) v[i] += red[q][i][lane];  // gemm13's order
    }
    if (t == 0) {  // token column 0: rows g / g + 8 are gate / up of feature tile * 8 + g
      const float gate = bf16_round(v[0]), up = bf16_round(v[2]);
      const float a = bf16_round(gate / (1.f + __expf(-gate)));
      p.act[(size_t)row * p.I + tile * 8 + g] = __float2bfloat16(a * up);
    }
    count_done(p.counters + row);
  }
  __syncthreads();  // red and xs are free for the block's next item
}

// One warp: the down rows of output tile `tile` for act row `row` over K = I, into acc (column 0), once that
// row is complete. Routed (SHARED false): int4 expert e, kDownOneTokU chunks in flight, as
// down_combine_one_token; SHARED: sd's bf16 rows, 2 chunks in flight, as shared_acc.
template <bool SHARED>
__device__ __forceinline__ void down_rows(const OneLaunch& p, int e, int row, int tile, float acc[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, KC = p.I >> 6, tiles = p.I / 8;
  constexpr int U = SHARED ? 2 : kDownOneTokU;
  const uint4* brow = g == 0 ? reinterpret_cast<const uint4*>(p.act + (size_t)row * p.I) + 2 * t : nullptr;
  const size_t base = ((size_t)max(e, 0) * (p.D / 16) + tile) * KC;
  const uint4* ra = reinterpret_cast<const uint4*>(p.sd + (size_t)(tile * 16 + g) * p.I) + 2 * t;  // SHARED
  const uint4* rb = ra + p.I;  // 8 rows further: 8 * I bf16
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c0 = 0; c0 < KC; c0 += U) {
    uint4 wv[U][SHARED ? 4 : 1];
    uint32_t sv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u;
      if (c >= KC) break;
      if constexpr (SHARED) {
#pragma unroll
        for (int q = 0; q < 2; ++q) wv[u][q] = __ldcs(ra + c * 8 + q), wv[u][2 + q] = __ldcs(rb + c * 8 + q);
      } else {
        wv[u][0] = __ldcs(p.w2 + (base + c) * 32 + lane);
        sv[u] = __ldg(p.s2 + (base + c) * 16 + 2 * g + (t >> 1));
      }
    }
    if (c0 == 0) wait_count(p.counters + row, tiles);  // the first weight batch is in flight meanwhile
    uint4 bv[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int q = 0; q < 2; ++q) bv[u][q] = brow && c0 + u < KC ? __ldcg(brow + (c0 + u) * 8 + q) : zero;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + u >= KC) break;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a[4];
        if constexpr (SHARED) {  // shared_acc's fragments
          const uint4 &A = wv[u][j >> 1], &B = wv[u][2 + (j >> 1)];
          a[0] = (j & 1) ? A.z : A.x, a[1] = (j & 1) ? B.z : B.x, a[2] = (j & 1) ? A.w : A.y;
          a[3] = (j & 1) ? B.w : B.y;
        } else {
          const uint32_t word = j == 0 ? wv[u][0].x : j == 1 ? wv[u][0].y : j == 2 ? wv[u][0].z : wv[u][0].w;
          dequant(word, sv[u], a);
        }
        const uint4 b = bv[u][j >> 1];
        mma_bf16(acc, a, (j & 1) ? b.z : b.x, (j & 1) ? b.w : b.y);
      }
    }
  }
}

// S item: the shared expert's down for output tiles [8 s, 8 s + 8), one warp each -> y_shared (bf16).
__device__ __forceinline__ void shared_down_item(const OneLaunch& p, int s) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, tile = s * kOneLaunchWarps + (threadIdx.x >> 5);
  if (tile >= p.D / 16) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  down_rows<true>(p, -1, p.topk, tile, acc);
  if (t == 0) {  // column 0 (the token): rows g and g + 8
    p.y_shared[tile * 16 + g] = __float2bfloat16(acc[0]);
    p.y_shared[tile * 16 + g + 8] = __float2bfloat16(acc[2]);
  }
  count_done(p.counters + kSharedDown);
}

// B item: output tile `tile` (16 rows of out), down_combine_one_token's arithmetic. All threads of the block.
__device__ __forceinline__ void down_item(const OneLaunch& p, int tile, float (*ys)[16], float* weight, int* live) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  int e = -1;
  float wgt = 0.f;
  if (warp < p.topk) {
    const int64_t id = __ldcg(p.ids + warp);
    if (id >= 0 && id < p.E) e = (int)id, wgt = __ldg(p.topw + warp);
  }
  if (lane == 0) live[warp] = e >= 0, weight[warp] = wgt;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (e >= 0) down_rows<false>(p, e, warp, tile, acc);
  if (t == 0) {  // column 0 (the token): rows g and g + 8, rounded as y is stored
    ys[warp][g] = bf16_round(acc[0]);
    ys[warp][g + 8] = bf16_round(acc[2]);
  }
  __syncthreads();
  if (threadIdx.x < 16) {  // warp 0
    const int r = threadIdx.x;
    float sum = 0.f;
    for (int k = 0; k < p.topk; ++k)
      if (live[k]) sum += weight[k] * ys[k][r];
    if (p.sd) {
      wait_count(p.counters + kSharedDown, p.D / 16);
      sum = bf16_round(sum) + __bfloat162float(__ldcg(p.y_shared + tile * 16 + r));
    }
    p.out[(size_t)tile * 16 + r] = __float2bfloat16(sum);
  }
  __syncthreads();  // ys / weight / live are free for the block's next item
}

static __global__ void __launch_bounds__(kOneLaunchThreads, 2)
    experts_one_launch(const __grid_constant__ OneLaunch p) {
  __shared__ uint4 xs[kOneTokMaxK / 8];
  __shared__ float red[kOneLaunchWarps][4][32];
  __shared__ float ys[kOneLaunchWarps][16];
  __shared__ float weight[kOneLaunchWarps];
  __shared__ int live[kOneLaunchWarps];
  pdl_trigger();  // the next kernel waits for this grid before reading out
  const int tiles13 = p.I / 8, tiles2 = p.D / 16;
  const int a_shared = p.sa ? tiles13 : 0, s_items = p.sa ? (tiles2 + kOneLaunchWarps - 1) / kOneLaunchWarps : 0;
  const int a_end = a_shared + s_items + p.topk * tiles13, items = a_end + tiles2;
  // One loop per kind (in the kinds' order, so an item never waits on a later one), each block striding.
  int item = blockIdx.x;
  bool waited = false;
  for (; item < a_shared; item += gridDim.x) gate_up_item(p, p.topk, item, waited, xs, red);  // waits itself
  // Everything else reads the ids or the counters: only after the previous grid completed (the header).
  if (!waited) pdl_wait();
  waited = true;
  for (; item < a_shared + s_items; item += gridDim.x) shared_down_item(p, item - a_shared);
  for (; item < a_end; item += gridDim.x) {
    const int i = item - a_shared - s_items;
    gate_up_item(p, i / tiles13, i % tiles13, waited, xs, red);
  }
  for (; item < items; item += gridDim.x) down_item(p, item - a_end, ys, weight, live);
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(p.counters + kDeparted, 1) == (int)gridDim.x - 1) {
    for (int i = 0; i < kOneLaunchCounters; ++i) p.counters[i] = 0;  // every block is done with them
  }
}

}  // namespace k26_moe
