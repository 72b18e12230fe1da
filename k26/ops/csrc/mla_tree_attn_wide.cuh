// MLA tree attention, the wide verify tile (-DK26_ATTN_WIDE, issue 16 "compute-bound verify path"): 64 query rows
// a block where the call has N x H >= 64 (verify trees at TP8's 8 heads from N = 8; decode with 64 heads), so
// every key tile a block brings in from L2 feeds 64 rows (the 32-row tile: 32), and the softmax runs in
// registers instead of a block-wide pass through shared memory.
//
// Same contract, split geometry, workspace, merge (csrc/mla_attn_merge.cuh) and PDL protocol as
// tree_attn_kernel (csrc/mla_tree_attn_kernel.cuh, which says what is computed); only the key loop differs.
//
// Warp roles: 8 warps = 4 row groups x 2 halves. Warp w owns rows 16 (w & 3) .. +16 of the tile and half
// h = w >> 2: S = Q K^T of its 16 rows x the tile's 16 keys over dims [288 h, 288 h + 288) (Q's A fragments live
// in registers: 18 k-steps, 72 registers), exchanged with the partner warp w ^ 4 through shared memory at a
// 64-thread named barrier, so both hold the whole S (fp32 addition commutes: the same bits in both). The online
// softmax then runs in registers in both warps (a row's max over its quad by two shuffles), P goes from the
// accumulator layout straight into the A fragment of P V, and each warp accumulates O for its 16 rows x 256 of
// the 512 output columns (128 registers). One block barrier a tile (it frees the stage of tile k - 1) and one
// pair barrier; the MMA count per tile is the minimum (no dim quarters summed in shared memory, no recompute).
//
// Measured (H100, 2026-12-06-attn-wide-tile-session28-h100.md): correct; faster where a split streams many keys
// (N = 16 at 128K 219 -> 184 µs, N = 64 at 32K 209 -> 184), slower at 1-4K (N = 16 at 4K 19.5 -> 24.7). With
// mma.sync the shared-memory bytes per FLOP follow the rows a warp owns (16 here, 32 in the 32-row tile's warps),
// so the wider block alone does not make the loop compute-bound; both tiles are latency-bound (ncu: < 40 % of
// issue slots). Hence an A/B side, and per sequence by length in csrc/mla_tree_attn_union.cuh.
//
// Q takes all four key stages while it is staged (64 rows x 1168 B = 4 x 16 keys), so no key tile can be in
// flight before the query is: instead the first three prefix tiles are prefetched into L2 before the
// grid-dependency wait, under the query projection's tail.
//
// Legality: mma.sync.m16n8k16 bf16, ldmatrix, cp.async, prefetch.global.L2, bar.sync with a thread count,
// griddepcontrol, ld.acquire and atomics (no warpgroup MMA, TMA, tensor memory or clusters); WideCfg::SMEM <=
// 99 KB: legal on sm_120 and sm_90; built for sm_90a and sm_120a. One block an SM (launch bounds: 255 registers).

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "mla_attn_common.cuh"
#include "mla_attn_merge.cuh"
#include "pdl.cuh"

namespace k26_attn {

struct WideCfg {
  static constexpr int BM = 64;
  static constexpr int HALF = DQK / 2;  // S dims a warp owns
  static constexpr int KS = HALF / 16;  // its k-steps
  static constexpr int VCOLS = DV / 2;  // O columns a warp owns
  static constexpr size_t K = (size_t)NSTAGE * BN * LDS * 2;  // key stages (Q staged there first)
  static constexpr size_t X = (size_t)(THREADS / 32) * 32 * 8 * 4;  // each lane's 8 partial scores
  static constexpr size_t WORDS = (size_t)BM * 4 * 8;  // each row's ancestor words (<= 4: N <= 256)
  static constexpr size_t SMEM = K + X + WORDS;
  static_assert((size_t)BM * LDS * 2 <= K, "Q is staged in the key stages");
  static_assert(KS % 2 == 0, "k-steps go in pairs (one ldmatrix.x4 of K)");
  static_assert(SMEM <= 101376, "sm_120 allows at most 99 KB of shared memory per block");
};

// 2^x by the SFU alone (exp2f without fast math adds a range check, a scaling and a squaring: ~80 of a tile's
// ~380 instructions here); differs from exp2f only where the result is denormal (flushed to 0), p < 2^-126.
// ex2.approx(-inf) = +0.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// The two warps of a row group (ids 1..4; 0 is __syncthreads).
__device__ __forceinline__ void pair_sync(int id) { asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory"); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The block's work for row tile rt, split `split` of sequence b (the kernel below, or the union kernel).
template <bool ROPE>
__device__ __forceinline__ void tree_attn_wide_body(const Params& p, const Rotary& rot, int rt, int split, int b) {
  using C = WideCfg;
  constexpr int BM = C::BM;
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem);
  float4* sX = reinterpret_cast<float4*>(smem + C::K);                // [warp][2][lane]: no bank conflicts
  int64_t* sWords = reinterpret_cast<int64_t*>(smem + C::K + C::X);  // [BM][4]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int grp = warp & 3, half = warp >> 2;
  const int row0 = rt * BM;
  // The split's keys and the query's staging as tree_attn_body's (written out in both: shared helpers changed
  // the measured 32-row kernel's SASS on one arch or the other, 2026-12-06).
  const int L = static_cast<int>(p.prefix[b]);
  const int T = live_keys(p, L);
  int chunk, active;
  split_geometry(p, T, chunk, active);
  if (split >= active) return;  // no keys for this split at this length: it takes no part in the merge
  const int k0 = split * chunk, k1 = min(T, k0 + chunk);
  const __nv_bfloat16* kv = p.cache + (size_t)p.rows[b] * p.max_len * DQK;
  const int n_tiles = (k1 - k0 + BN - 1) / BN;
  {  // the first tiles' prefix keys (never written in this step) into L2 before the wait: 9 lines a key
    const int kend = min(min(k1, L), k0 + (NSTAGE - 1) * BN);
    for (int i = tid; i < (kend - k0) * (DQK * 2 / 128); i += THREADS) prefetch_l2(kv + (size_t)k0 * DQK + i * 64);
  }
  pdl_wait();
  pdl_trigger();
  for (int i = tid; i < BM * CHUNK_PER_ROW; i += THREADS) {  // Q -> the key stages
    const int r = i / CHUNK_PER_ROW, c = (i % CHUNK_PER_ROW) * 8;
    const size_t row = (size_t)b * p.R + min(row0 + r, p.R - 1);
    const __nv_bfloat16* src = !ROPE ? p.q + row * DQK + c
                               : c < DV ? p.q + row * DV + c
                                        : rot.q_pe + row * rot.pe_ld + (c - DV);
    cp_async16(sK + r * LDS + c, src, row0 + r < p.R);
  }
  cp_commit();
  RotaryPairs<ROPE, BM> rope;
  rope.load(p, rot, b, row0, tid);
  stage_words<BM>(p, b, row0, sWords, tid);
  rope.cos_sin();
  cp_wait<0>();
  __syncthreads();
  if constexpr (ROPE) {
    rope.rotate(sK, p, row0, tid);
    __syncthreads();
  }
  uint32_t qa[C::KS][4];
#pragma unroll
  for (int kk = 0; kk < C::KS; ++kk)
    ldsm_x4(qa[kk], sK + (grp * 16 + (lane & 15)) * LDS + half * C::HALF + kk * 16 + (lane >> 4) * 8);
  __syncthreads();  // Q read: the stages take key tiles
  auto load_tile = [&](int it) {
    if (it < n_tiles) copy_key_tile<2>(kv, k0 + it * BN, k1, sK + (it % NSTAGE) * BN * LDS, tid);
    cp_commit();  // always commit, so the group count per iteration stays uniform
  };
  for (int it = 0; it < NSTAGE - 1; ++it) load_tile(it);

  const int64_t* words0 = sWords + (grp * 16 + g) * 4;  // rows g and g + 8 of the warp's 16
  float o[C::VCOLS / 8][4];
#pragma unroll
  for (int n = 0; n < C::VCOLS / 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.f;
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_run[2] = {0.f, 0.f};

  for (int k = 0; k < n_tiles; ++k) {
    cp_wait<NSTAGE - 2>();  // tile k landed
    __syncthreads();        // ... for every thread; and tile k - 1 is done everywhere: its stage is free
    load_tile(k + NSTAGE - 1);
    const __nv_bfloat16* tK = sK + (k % NSTAGE) * BN * LDS;

    // S over this warp's half of the dims: keys nt * 8 .. +8; two accumulators a key n-tile halve the chain.
    float s[2][4], s2[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = s2[nt][i] = 0.f;
      const __nv_bfloat16* kb = tK + (nt * 8 + (lane & 7)) * LDS + half * C::HALF + (lane >> 3) * 8;
#pragma unroll
      for (int kk = 0; kk < C::KS; kk += 2) {
        uint32_t bk[4];
        ldsm_x4(bk, kb + kk * 16);
        mma_bf16(s[nt], qa[kk], bk[0], bk[1]);
        mma_bf16(s2[nt], qa[kk + 1], bk[2], bk[3]);
      }
    }
    // The partner's half through shared memory: lane l of both warps holds the same (row, key) positions.
    // One buffer suffices: the partner's read of tile k precedes the block barrier of tile k + 1.
    float v[2][4];  // the whole S in the accumulator layout: [key n-tile][row g: c0, c1; row g + 8: c2, c3]
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) v[nt][i] = s[nt][i] + s2[nt][i];
    float4* mine = sX + warp * 64 + lane;
    mine[0] = make_float4(v[0][0], v[0][1], v[0][2], v[0][3]);
    mine[32] = make_float4(v[1][0], v[1][1], v[1][2], v[1][3]);
    pair_sync(1 + grp);
    const float4* other = sX + (warp ^ 4) * 64 + lane;
    const float4 b0 = other[0], b1 = other[32];
    v[0][0] += b0.x, v[0][1] += b0.y, v[0][2] += b0.z, v[0][3] += b0.w;
    v[1][0] += b1.x, v[1][1] += b1.y, v[1][2] += b1.z, v[1][3] += b1.w;

    const int key0 = k0 + k * BN;
    const bool all_visible = key0 + BN <= min(L, k1);  // block-uniform: wholly prefix keys
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = key0 + nt * 8 + 2 * t + (i & 1);
        bool vis = true;
        if (!all_visible) {
          const int j = min(max(key - L, 0), p.N - 1);
          const int64_t w = words0[(i >> 1) * 32 + (j >> 6)];  // row g + 8 is 8 rows (32 words) on
          vis = (key < k1) & ((key < L) | static_cast<bool>((w >> (j & 63)) & 1));
        }
        v[nt][i] = vis ? v[nt][i] * p.scale_log2 : -CUDART_INF_F;
      }
    uint32_t pa[4];
    float alpha[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // row g (c0, c1 of each n-tile), row g + 8 (c2, c3)
      float mx = fmaxf(fmaxf(v[0][2 * hh], v[0][2 * hh + 1]), fmaxf(v[1][2 * hh], v[1][2 * hh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[hh], mx);
      float pr[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) pr[j] = m_new == -CUDART_INF_F ? 0.f : ex2_approx(v[j >> 1][2 * hh + (j & 1)] - m_new);
      alpha[hh] = m_new == -CUDART_INF_F ? 1.f : ex2_approx(m_run[hh] - m_new);  // 0 when m_run is -inf
      l_run[hh] = l_run[hh] * alpha[hh] + ((pr[0] + pr[1]) + (pr[2] + pr[3]));  // unrounded p, as FlashAttention
      m_run[hh] = m_new;
      pa[hh] = pack_bf16(pr[0], pr[1]);      // A fragment: a0 row g / a1 row g + 8, keys 2t, 2t + 1
      pa[2 + hh] = pack_bf16(pr[2], pr[3]);  // a2 / a3: keys 8 + 2t, 9 + 2t
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // warp-uniform: x 1 changes nothing
#pragma unroll
      for (int n = 0; n < C::VCOLS / 8; ++n)
        o[n][0] *= alpha[0], o[n][1] *= alpha[0], o[n][2] *= alpha[1], o[n][3] *= alpha[1];
    }
    // O += P V over this warp's 256 columns, V = the first 512 dims of the tile's keys (ldmatrix.trans).
#pragma unroll
    for (int n2 = 0; n2 < C::VCOLS / 16; ++n2) {
      uint32_t vb[4];
      ldsm_x4_t(vb, tK + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + half * C::VCOLS + n2 * 16 + (lane >> 4) * 8);
      mma_bf16(o[2 * n2], pa, vb[0], vb[1]);
      mma_bf16(o[2 * n2 + 1], pa, vb[2], vb[3]);
    }
  }
  cp_wait<0>();  // no copy may land in shared memory after the block exits

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 1);
    l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 2);
  }
  // This split's normalised partial, straight from the registers (as tree_attn_kernel).
  const SplitOut<BM> so(p, b, rt, active, tid);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = grp * 16 + g + hh * 8;
    if (r >= so.rows_real) continue;
    const float inv = l_run[hh] > 0.f ? 1.f / l_run[hh] : 0.f;
#pragma unroll
    for (int n = 0; n < C::VCOLS / 8; ++n) {
      const int c = half * C::VCOLS + n * 8 + 2 * t;
      const float2 val = make_float2(o[n][2 * hh] * inv, o[n][2 * hh + 1] * inv);
      if (active == 1)
        *reinterpret_cast<__nv_bfloat162*>(so.out + (size_t)r * DV + c) = __float22bfloat162_rn(val);
      else
        store_part2(so.op + ((size_t)split * BM + r) * DV + c, val);
    }
    if (half == 0 && t == 0) so.put_lse(r, split, active, m_run[hh], l_run[hh]);
  }
  if (active == 1) return;
  tile_barrier(so.bar, so.gen, active, split == 0);
  merge_share<BM>(so.lp, so.op, so.out, so.lse, active, so.rows_real, split, active);
}

template <bool ROPE>
static __global__ void __launch_bounds__(THREADS, 1) tree_attn_wide_kernel(Params p, Rotary rot) {
  tree_attn_wide_body<ROPE>(p, rot, blockIdx.x, blockIdx.y, blockIdx.z);
}

}  // namespace k26_attn
