// The fused INT4 MoE kernel's grouped swap-AB GEMM (gate/up with silu·up, or down) over one expert group of
// the routing table per blockIdx.y (csrc/moe_w4a16.cu launches it and describes the layouts; the one-token
// and the one-launch down + combine paths live in csrc/moe_one_token.cuh and csrc/moe_down_combine.cuh).
//
// Legality: as moe_w4a16.cu (mma.sync, plain loads, prefetch, griddepcontrol; <= 32 KB static shared memory).

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "moe_mma.cuh"
#include "moe_gate_up_one_token.cuh"
#include "pdl.cuh"

#ifndef MOE_TRACE  // phase stamps: csrc/moe_w4a16.cu defines it (-DK26_MOE_TRACE)
#define MOE_TRACE(table, k)
#endif

namespace k26_moe {

// 2./3. Grouped swap-AB GEMM over one expert group per blockIdx.y.
//   RT: 16-row tiles per warp (B fragments reused across them); NT: 8-token column tiles;
//   WK: warps splitting K (reduced in shared memory); WM: warps on different row tiles.
//   GATED: gate/up interleaved tiles -> act[slot, I] bf16; else down -> y[pair, D] bf16.

// Chunks in flight per warp in the general loop (3 in the two-tile gate/up GEMM on sm_90: kGateUpThreePerSM).
template <int RT, int NT, bool GATED>
constexpr int kRoundChunks = GATED && RT == 2 && NT == 1 && kGateUpThreePerSM ? 3 : NT <= 1 ? 4 : 2;

// MINB 3 keeps the one-token-tile kernels at 3 blocks per SM on sm_90 (M = 1 with the shared expert is 288
// gate/up blocks: one wave on 132 SMs), and the two-tile gate/up GEMM (kGateUpThreePerSM). On sm_120 the
// two-tile gate/up GEMM keeps 1 (with 4 chunks a round it would spill at 3); the one-token-tile kernels keep
// their 3 (78 registers, no spills, sm_120a; at 1 they took 84-92 registers: 2 blocks an SM), and the two-tile
// down GEMM its 2 (124 registers, no spills).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define K26_MINB(m, two_tile_gated) ((two_tile_gated) ? 1 : (m))
#else
#define K26_MINB(m, two_tile_gated) (m)
#endif

// Table-driven gate/up blocks: the first round of the warp's weight and scale chunks (the loop's U chunks of
// each of its RT row tiles, its k range's start) prefetched into L2 as soon as the expert is known. Without it
// no weight byte is requested until `sorted` (a second dependent L2 round trip after the table's fields) has
// come back, since the loop's first loads are issued after the activation rows' addresses are formed. Same
// bits (prefetches only). Measured with the one-token x copy below (H100, bench_moe --block, TP8 shapes, three
// rounds): M = 16 uniform 112.0 -> 111.1 µs, skewed 42.6 -> 42.1 (2026-12-06-moe-variants-session28-h100.md).
template <int RT, int NT, int WK, int WM>
__device__ __forceinline__ void early_weights(const uint4* w, const uint32_t* s, int e, int n_tiles, int KC) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile0 = (blockIdx.x * WM + warp / WK) * RT;
  if (tile0 >= n_tiles) return;
  const int c_begin = (warp % WK) * KC / WK, c_end = (warp % WK + 1) * KC / WK;
  const size_t tile_base = ((size_t)e * n_tiles + tile0) * KC;
#pragma unroll
  for (int u = 0; u < kRoundChunks<RT, NT, true>; ++u) {
    if (c_begin + u >= c_end) break;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const size_t chunk = tile_base + (size_t)r * KC + c_begin + u;
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(w + chunk * 32 + lane));  // 512 B: 4 lines a warp
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(s + chunk * 16));
    }
  }
}

// Groups from the ids (no routing table; the gate/up GEMM at nt = 1 when csrc/moe_w4a16.cu's launch takes
// that path): routed group y (blockIdx.y past the shared expert's groups) is the routing table's group y — the
// groups in expert order, ceil(count / GT) of each expert, group j of expert e its occurrences GT j .. GT j +
// GT - 1 in pair order — found by every block from the ids: one coherent read of every id (the router's
// output), a shared-memory count per expert and a scan, where the table costs the router kernel's last block a
// build (~3.6 µs of its tail at M = 16 on an H100, profiling/debug/router_trace.py --table) and this kernel two
// dependent reads of it. The live groups keep the grid's first rows, as with the table (groups led by a pair,
// blockIdx.y = pair, spread them over the grid: the verify N = 16 step's gate/up path 28.8 -> 34.6 µs).
// Block-uniform: true with the expert in *e and the pairs in members[0, len), false for no such group.
constexpr int kOwnMaxPairs = 512;    // 64 tokens at top-8: two ids a thread of the 256-thread gate/up block
constexpr int kOwnMaxExperts = 512;  // the per-expert counts in shared memory
template <int THREADS, int GT>
__device__ __forceinline__ bool group_from_ids(const int64_t* __restrict__ ids, int y, int P, int E, int* members,
                                               int* e, int* len) {
  static_assert(kOwnMaxPairs % THREADS == 0 && kOwnMaxExperts % THREADS == 0, "every pair and expert owned");
  constexpr int R = kOwnMaxPairs / THREADS, EPT = kOwnMaxExperts / THREADS, NW = THREADS / 32;
  __shared__ int cnt[kOwnMaxExperts], warp_tot[NW], s_e, s_j;
  __shared__ unsigned bits[kOwnMaxPairs / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t id[R];
#pragma unroll
  for (int r = 0; r < R; ++r) id[r] = r * THREADS + tid < P ? __ldcg(ids + r * THREADS + tid) : -1;
  for (int x = tid; x < E; x += THREADS) cnt[x] = 0;
  if (tid == 0) s_e = -1;
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (id[r] >= 0 && id[r] < E) atomicAdd(&cnt[id[r]], 1);
  __syncthreads();
  // Groups per expert, scanned in expert order: thread t owns experts [EPT t, EPT t + EPT).
  int own = 0;
#pragma unroll
  for (int i = 0; i < EPT; ++i) own += EPT * tid + i < E ? (cnt[EPT * tid + i] + GT - 1) / GT : 0;
  int inc = own;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(~0u, inc, o);
    if (lane >= o) inc += v;
  }
  if (lane == 31) warp_tot[warp] = inc;
  __syncthreads();
  int pre = inc - own;
  for (int w = 0; w < warp; ++w) pre += warp_tot[w];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int x = EPT * tid + i, g = x < E ? (cnt[x] + GT - 1) / GT : 0;
    if (y >= pre && y < pre + g) s_e = x, s_j = y - pre;
    pre += g;
  }
  __syncthreads();
  const int ex = s_e, j = s_j;
  if (ex < 0) return false;  // past the last group
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const unsigned b = __ballot_sync(~0u, id[r] == ex);
    if (lane == 0) bits[r * NW + warp] = b;
  }
  __syncthreads();
  if (tid < GT) {  // member tid: occurrence GT j + tid of the expert, in pair order
    int want = GT * j + tid, m = -1;
    for (int w = 0; w < (P + 31) / 32 && m < 0; ++w) {
      unsigned v = bits[w];
      const int c = __popc(v);
      if (want >= c) {
        want -= c;
        continue;
      }
      for (int k = 0; k < want; ++k) v &= v - 1;  // drop the lower occurrences
      m = w * 32 + __ffs(v) - 1;
    }
    members[tid] = m;
  }
  __syncthreads();
  *e = ex, *len = min(GT, cnt[ex] - GT * j);
  return true;
}

template <int RT, int NT, int WK, int WM, bool GATED, int MINB>
static __global__ void __launch_bounds__(32 * WK * WM, K26_MINB(MINB, RT == 2 && GATED)) gemm_kernel(
    const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ w, const uint32_t* __restrict__ s, int K,
    int n_tiles, int topk, const int* __restrict__ sorted, const int* __restrict__ grp_expert,
    const int* __restrict__ grp_start, const int* __restrict__ grp_len, const int* __restrict__ num_groups,
    __nv_bfloat16* __restrict__ out, int out_ld, int E, int P, int S, const __nv_bfloat16* __restrict__ sa,
    const __nv_bfloat16* __restrict__ sb, const int64_t* __restrict__ direct, const int64_t* __restrict__ own_ids) {
  // PDL (launched by `launch` with the attribute): the shared expert's groups come first in the table
  // (csrc/moe_route.cuh), so those blocks know their tokens without it and run the gate/up GEMM while the
  // routing (route_kernel, or a table producer that triggers early) still runs; every other block waits for the previous grid before reading
  // anything it wrote. gate/up blocks let the down GEMM launch once past that wait (so the down GEMM may
  // read the table early); down GEMM blocks let the combine launch at once (it waits for them).
  MOE_TRACE(GATED ? 0 : 1, 0);
  const int grp = blockIdx.y, gt = 8 * NT;
  const bool shared = grp * gt < S;
  int e = E, start = P + grp * gt, len = min(gt, S - grp * gt);
  // own_ids (GATED, NT = 1): the routed groups from the ids (group_from_ids); members[n] is column n's pair,
  // and its act row (the down + combine kernel builds its own table: csrc/moe_down_combine.cuh).
  __shared__ int members[GATED && NT == 1 ? 8 : 1];
  const bool own = GATED && NT == 1 && own_ids != nullptr && !shared;
  if (!GATED) pdl_trigger();
  if (!shared) {
    if (GATED) pdl_wait();
    if (GATED) pdl_trigger();
    if (direct != nullptr) {  // no table: routed group j is pair j (slot j), its expert straight from the ids
      const int j = grp - (S + gt - 1) / gt;
      if (j >= P) return;
      const int64_t id = __ldcg(direct + j);
      if (id < 0 || id >= E) return;
      e = (int)id, start = j, len = 1;
    } else if (own) {
      if constexpr (GATED && NT == 1)
        if (!group_from_ids<32 * WK * WM, 8>(own_ids, grp - (S + gt - 1) / gt, P, E, members, &e, &len)) return;
      start = 0;
      if (GATED) early_weights<RT, NT, WK, WM>(w, s, e, n_tiles, K >> 6);
    } else {
      // grp < the grid's G groups, so the group's fields are in bounds: read with the count, one round trip
      const int ng = __ldcg(num_groups), ge = __ldcg(grp_expert + grp), gs = __ldcg(grp_start + grp),
                gl = __ldcg(grp_len + grp);
      if (grp >= ng) return;
      e = ge, start = gs, len = gl;
      if (GATED) early_weights<RT, NT, WK, WM>(w, s, e, n_tiles, K >> 6);
    }
  } else if (GATED) {
    pdl_trigger();
  }
  MOE_TRACE(GATED ? 0 : 1, 1);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wk = warp % WK, wm = warp / WK;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = (blockIdx.x * WM + wm) * RT;
  const bool active = tile0 < n_tiles;  // n_tiles is a multiple of RT
  const int KC = K >> 6;

  // Activation row of the token in column g of each n-tile (nullptr: padding column, contributes 0).
  const uint4* brow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int n = nt * 8 + g;
    brow[nt] = nullptr;
    if (n < len) {
      const int slot = start + n;
      const int pair = own ? members[n] : shared || direct != nullptr ? slot : __ldcg(sorted + slot);
      const size_t row = GATED ? (size_t)(shared ? slot - P : pair / topk) : (size_t)slot;
      brow[nt] = reinterpret_cast<const uint4*>(x + row * K) + 2 * t;
    }
  }

  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][nt][i] = 0.f;

  if (!GATED) {
    if (active && !shared) {  // the down GEMM's weights (RT tiles) into L2 while the gate/up GEMM finishes
      const size_t base = ((size_t)e * n_tiles + tile0) * KC;
      for (int c = 0; c < RT * KC; ++c) {
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(w + (base + c) * 32 + lane));
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(s + (base + c) * 16));
      }
    }
    pdl_wait();  // act comes from the gate/up GEMM
  }
  bool one_token = false;  // block-uniform: len and (WM = 1 for the gated GEMM) active
  if constexpr (GATED && RT == 1 && NT == 1 && WM == 1) {
    one_token = active && !shared && len == 1 && K <= kOneTokMaxK;
    __shared__ uint4 xs[GATED && RT == 1 && NT == 1 && WM == 1 ? kOneTokMaxK / 8 : 1];
    if (one_token) {
      const int pair = own ? members[0] : direct != nullptr ? start : __ldcg(sorted + start);
      gated_one_token(w, s, x + (size_t)(pair / topk) * K, K, ((size_t)e * n_tiles + tile0) * KC, wk * KC / WK,
                      (wk + 1) * KC / WK, xs, acc[0][0]);
    }
  }
  if (one_token) {
  } else if (active && shared) {
    shared_acc<RT, NT, GATED>(sa, sb, K, tile0, wk * KC / WK, (wk + 1) * KC / WK, brow, acc);
  } else if (active) {
    const int c_begin = wk * KC / WK, c_end = (wk + 1) * KC / WK;
    const size_t tile_base = ((size_t)e * n_tiles + tile0) * KC;
    constexpr int U = kRoundChunks<RT, NT, GATED>;
    for (int c0 = c_begin; c0 < c_end; c0 += U) {
      uint4 wv[U][RT];
      uint32_t sv[U][RT];
      uint4 bv[U][NT][2];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u;
        if (c < c_end) {
#pragma unroll
          for (int r = 0; r < RT; ++r) {
            const size_t chunk = tile_base + (size_t)r * KC + c;
            wv[u][r] = ld_weight(w + chunk * 32 + lane);  // streamed once: evict-first, keep L2 for activations
            sv[u][r] = __ldg(s + chunk * 16 + 2 * g + (t >> 1));  // rows g, g+8 of group t/2
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if (brow[nt] != nullptr) {
              bv[u][nt][0] = ld_act(brow[nt] + c * 8);  // x / act: coherent (pdl.cuh)
              bv[u][nt][1] = ld_act(brow[nt] + c * 8 + 1);
            } else {
              bv[u][nt][0] = make_uint4(0, 0, 0, 0);
              bv[u][nt][1] = make_uint4(0, 0, 0, 0);
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + u < c_end) mma_chunk<RT, NT>(wv[u], sv[u], bv[u], acc);
    }
  }

  if constexpr (WK > 1) {
    __shared__ float red[WM][WK][RT * NT * 4][32];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[wm][wk][(r * NT + nt) * 4 + i][lane] = acc[r][nt][i];
    __syncthreads();
    if (wk != 0) return;  // WK > 1 is only used by the gated GEMM, which has no block-wide epilogue
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float v = 0.f;
#pragma unroll
          for (int q = 0; q < WK; ++q) v += red[wm][q][(r * NT + nt) * 4 + i][lane];
          acc[r][nt][i] = v;
        }
  }
  MOE_TRACE(GATED ? 0 : 1, 2);
  pdl_wait();  // shared-expert blocks computed early; they write only once the previous grid is done
  if (active) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // token columns 2t and 2t+1
          const int n = nt * 8 + 2 * t + h;
          if (n >= len) continue;
          if constexpr (GATED) {
            // Rows g / g+8 of the tile are gate / up of feature (tile*8 + g); reference rounding points.
            const float gate = bf16_round(acc[r][nt][h]), up = bf16_round(acc[r][nt][2 + h]);
            const float act = bf16_round(gate / (1.f + __expf(-gate)));
            const int row = own ? members[n] : start + n;
            out[(size_t)row * out_ld + (tile0 + r) * 8 + g] = __float2bfloat16(act * up);
          } else {
            const int pair = shared || direct != nullptr ? start + n : __ldcg(sorted + start + n);
            const size_t row = (size_t)pair * out_ld + (tile0 + r) * 16 + g;
            out[row] = __float2bfloat16(acc[r][nt][h]);
            out[row + 8] = __float2bfloat16(acc[r][nt][2 + h]);
          }
        }
      }
    }
  }
  MOE_TRACE(GATED ? 0 : 1, 3);
}

}  // namespace k26_moe
