// MLA tree attention, the 32-row verify tile on 16 warps (-DK26_ATTN_W16, an A/B side; issue 16 "compute-bound
// verify path"). Same contract, split geometry, shared-memory layout (Cfg<2>), workspace, merge and PDL protocol
// as tree_attn_kernel<2> (csrc/mla_tree_attn_kernel.cuh, which says what is computed); only the warp roles differ.
//
// Why: the 8-warp 32-row tile runs a 16-key interval in ~1 µs for ~0.3 µs of MMAs and shared-memory reads (N = 16
// at 32K / 128K: 21-26 % of the mma.sync peak), with two warps a scheduler to hide each warp's chain (two m-tiles of
// S's MMAs, the softmax's shared-memory loads and shuffles, two m-tiles of P V). L2 prefetching ahead of the copies
// did not move it (2026-12-06-attn-l2-ahead-session34-h100.md): the chain, not the copies, is the bound. Here each
// warp owns one m-tile, so its chain is half as long, and four warps a scheduler interleave; each K / V fragment
// is then read from shared memory by two warps instead of one (~70 KB a tile instead of ~35: the throughput bound
// moves from ~410 to ~660 cycles a tile, still well under today's ~1,900).
//
// Warp roles (w = 0..15): S: rows 16 (w & 1) .. +16, keys 8 ((w >> 1) & 1) .. +8 of the tile, dims 144 (w >> 2) ..
// +144 (Q's A fragments in registers: 9 k-steps, 36 registers), partial sums through shared memory as before;
// softmax: thread t holds row t / 16, key t % 16 (a row's max over 16 lanes); P V: rows 16 (w & 1) .. +16, output
// columns 64 (w >> 1) .. +64 (32 registers of O). One barrier a tile, software-pipelined as the 8-warp tile's
// one-barrier loop (interval k: softmax of tile k, S of tile k + 1, P V of tile k - 1).
//
// Legality: mma.sync.m16n8k16 bf16, ldmatrix, cp.async, griddepcontrol, ld.acquire and atomics (no warpgroup MMA,
// TMA, tensor memory or clusters); Cfg<2>::SMEM <= 99 KB; 512 threads at <= 128 registers: legal on sm_120 and
// sm_90; built for sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "mla_attn_common.cuh"
#include "mla_attn_merge.cuh"
#include "pdl.cuh"

namespace k26_attn {

constexpr int W16_THREADS = 512;

// One 16-key tile by 16 warps: warp w copies key w (72 16-byte chunks: lane l takes l, l + 32 and, for l < 8,
// l + 64); keys from k1 on are zero-filled (their source clamped to a valid row).
__device__ __forceinline__ void copy_key_tile_w16(const __nv_bfloat16* kv, int key0, int k1, __nv_bfloat16* dst,
                                                  int tid) {
  static_assert(BN == W16_THREADS / 32 && CHUNK_PER_ROW == 72, "a key of 72 chunks a warp");
  const int lane = tid & 31, r = tid >> 5;
  const bool v = key0 + r < k1;
  const __nv_bfloat16* s = kv + (size_t)min(key0 + r, k1 - 1) * DQK + lane * 8;
  __nv_bfloat16* d = dst + r * LDS + lane * 8;
  cp_async16(d, s, v);
  cp_async16(d + 256, s + 256, v);
  if (lane < 8) cp_async16(d + 512, s + 512, v);
}

template <bool ROPE>
__device__ __forceinline__ void tree_attn_w16_body(const Params& p, const Rotary& rot, int rt, int split, int b) {
  using C = Cfg<2>;
  constexpr int BM = C::BM;
  static_assert(C::SBUF == 2 && NSTAGE == 4, "two score / P / alpha buffers; stages of tiles k - 1 .. k + 2");
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem);
  float* sS = reinterpret_cast<float*>(smem + C::K);  // [2][KQ][BM][LDSS]
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + C::K + C::S);  // [2][BM][LDP]
  int64_t* sWords = reinterpret_cast<int64_t*>(smem + C::K + C::S + C::P);
  float* sAlpha = reinterpret_cast<float*>(smem + C::K + C::S + C::P + C::WORDS);  // [2][BM]
  float* sM = sAlpha + 2 * BM;
  float* sL = sM + BM;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int row0 = rt * BM;
  const int L = static_cast<int>(p.prefix[b]);
  const int T = live_keys(p, L);
  int chunk, active;
  split_geometry(p, T, chunk, active);
  if (split >= active) return;
  const int k0 = split * chunk, k1 = min(T, k0 + chunk);
  const __nv_bfloat16* kv = p.cache + (size_t)p.rows[b] * p.max_len * DQK;
  const int n_tiles = (k1 - k0 + BN - 1) / BN;
  // Q staged in the last two stages, the first two tiles beside it (the prefix ones before the wait), as MT 2's
  // tile loop.
  __nv_bfloat16* const sQ = sK + 2 * BN * LDS;
  auto issue_tile = [&](int it) {
    copy_key_tile_w16(kv, k0 + it * BN, k1, sK + (it % NSTAGE) * BN * LDS, tid);
  };
  auto early = [&](int it) { return it < n_tiles && k0 + (it + 1) * BN <= L; };
  for (int it = 0; it < 2; ++it)
    if (early(it)) issue_tile(it);
  pdl_wait();
  pdl_trigger();
  for (int i = tid; i < BM * CHUNK_PER_ROW; i += W16_THREADS) {
    const int r = i / CHUNK_PER_ROW, c = (i % CHUNK_PER_ROW) * 8;
    const size_t row = (size_t)b * p.R + min(row0 + r, p.R - 1);
    const __nv_bfloat16* src = !ROPE ? p.q + row * DQK + c
                               : c < DV ? p.q + row * DV + c
                                        : rot.q_pe + row * rot.pe_ld + (c - DV);
    cp_async16(sQ + r * LDS + c, src, row0 + r < p.R);
  }
  for (int it = 0; it < 2; ++it)
    if (it < n_tiles && !early(it)) issue_tile(it);
  cp_commit();
  // The rotary pairs are shared out over THREADS (256) threads: the upper half of the block holds none.
  const bool rope_thread = tid < THREADS;
  RotaryPairs<ROPE, BM> rope;
  if (rope_thread) rope.load(p, rot, b, row0, tid);

  const int m = warp & 1, nt = (warp >> 1) & 1, kq = warp >> 2, cg = warp >> 1;
  uint32_t qa[KSTEPS][4];
  if (rope_thread) rope.cos_sin();
  cp_wait<0>();
  __syncthreads();
  if constexpr (ROPE) {
    if (rope_thread) rope.rotate(sQ, p, row0, tid);
    __syncthreads();
  }
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk)
    ldsm_x4(qa[kk], sQ + (m * 16 + (lane & 15)) * LDS + kq * 144 + kk * 16 + (lane >> 4) * 8);
  __syncthreads();  // Q read: its stages may now be written
  if (2 < n_tiles) issue_tile(2);
  cp_commit();

  const int sr = tid >> 4, sc = tid & 15;  // softmax role: row sr, key sc of each tile
  stage_words<BM>(p, b, row0, sWords, tid);  // (entries < 128 <= tid's first index from 256 on: no overlap)
  const int64_t* my_words = sWords + sr * 4;
  float m_run = -CUDART_INF_F, l_run = 0.f;
  float o[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.f;

  // S partial of this warp's m-tile, key n-tile and dim quarter for the tile in `stage`.
  auto score_mma = [&](int stage, float (&s)[4]) {
    const __nv_bfloat16* kb = sK + stage * BN * LDS + (nt * 8 + (lane & 7)) * LDS + kq * 144;
    float s2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = 0.f;
#pragma unroll
    for (int kk = 0; kk + 1 < KSTEPS; kk += 2) {
      uint32_t bk[4];
      ldsm_x4(bk, kb + kk * 16 + (lane >> 3) * 8);
      mma_bf16(s, qa[kk], bk[0], bk[1]);
      mma_bf16(s2, qa[kk + 1], bk[2], bk[3]);
    }
    uint32_t bl[2];
    ldsm_x2(bl, kb + (KSTEPS - 1) * 16 + ((lane >> 3) & 1) * 8);
    mma_bf16(s, qa[KSTEPS - 1], bl[0], bl[1]);
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] += s2[i];
  };
  auto score_store = [&](const float (&s)[4], int buf) {
    float* sSq = sS + buf * (KQ * BM * LDSS) + kq * BM * LDSS;
    *reinterpret_cast<float2*>(sSq + (m * 16 + g) * LDSS + nt * 8 + 2 * t) = make_float2(s[0], s[1]);
    *reinterpret_cast<float2*>(sSq + (m * 16 + g + 8) * LDSS + nt * 8 + 2 * t) = make_float2(s[2], s[3]);
  };
  // Online softmax of the tile starting at key0 (this thread's one key of row sr): P -> sP, alpha -> sAlpha.
  auto softmax_tile = [&](int key0, int buf) {
    const int key = key0 + sc;
    const int i = min(max(key - L, 0), p.N - 1);  // the bit without a branch, i clamped to the row's N bits
    const bool vis = (key < k1) & ((key < L) | static_cast<bool>((my_words[i >> 6] >> (i & 63)) & 1));
    float acc = 0.f;
#pragma unroll
    for (int q4 = 0; q4 < KQ; ++q4) acc += sS[buf * (KQ * BM * LDSS) + (q4 * BM + sr) * LDSS + sc];
    const float sv = vis ? acc * p.scale_log2 : -CUDART_INF_F;
    float mx = sv;
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float m_new = fmaxf(m_run, mx);
    const float pj = m_new == -CUDART_INF_F ? 0.f : exp2f(sv - m_new);
    sP[buf * (BM * LDP) + sr * LDP + sc] = __float2bfloat16(pj);
    const float alpha = m_new == -CUDART_INF_F ? 1.f : exp2f(m_run - m_new);  // 0 when m_run is -inf
    l_run = l_run * alpha + pj;  // unrounded P, as the 8-warp tile
    m_run = m_new;
    if (sc == 0) sAlpha[buf * BM + sr] = alpha;
  };
  // O = alpha O + P V over this warp's rows and 64 columns, V = the first 512 dims of the tile in `stage`.
  auto pv_tile = [&](int stage, int buf) {
    const float al0 = sAlpha[buf * BM + m * 16 + g], al1 = sAlpha[buf * BM + m * 16 + g + 8];
#pragma unroll
    for (int n = 0; n < 8; ++n) o[n][0] *= al0, o[n][1] *= al0, o[n][2] *= al1, o[n][3] *= al1;
    uint32_t pa[4];
    ldsm_x4(pa, sP + buf * (BM * LDP) + (m * 16 + (lane & 15)) * LDP + (lane >> 4) * 8);
    const __nv_bfloat16* tK = sK + stage * BN * LDS;
#pragma unroll
    for (int n2 = 0; n2 < 4; ++n2) {
      uint32_t vb[4];
      ldsm_x4_t(vb, tK + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + cg * 64 + n2 * 16 + (lane >> 4) * 8);
      mma_bf16(o[2 * n2], pa, vb[0], vb[1]);
      mma_bf16(o[2 * n2 + 1], pa, vb[2], vb[3]);
    }
  };

  {
    float s[4];
    score_mma(0, s);
    score_store(s, 0);
  }
  cp_wait<1>();  // tile 1 landed (tile 2 may still be in flight)
  __syncthreads();
  softmax_tile(k0, 0);
  {
    float s[4];
    score_mma(1 % NSTAGE, s);  // n_tiles 1: a stale stage; unused
    score_store(s, 1);
  }
  for (int k = 1; k < n_tiles; ++k) {
    cp_wait<0>();     // tile k + 1 landed
    __syncthreads();  // S(k), P(k - 1) visible; interval k - 1 done everywhere: tile k - 2's stage is free
    issue_tile(k + 2);  // past the last tile: zero-fills, no reads
    cp_commit();
    pv_tile((k - 1) % NSTAGE, (k - 1) & 1);
    float s[4];
    score_mma((k + 1) % NSTAGE, s);  // past the last tile a stale stage; the result is unused
    softmax_tile(k0 + k * BN, k & 1);
    score_store(s, (k + 1) & 1);  // after the softmax's loads of the other buffer
  }
  __syncthreads();
  pv_tile((n_tiles - 1) % NSTAGE, (n_tiles - 1) & 1);
  cp_wait<0>();  // no copy may land in shared memory after the block exits

#pragma unroll
  for (int off = 8; off > 0; off >>= 1) l_run += __shfl_xor_sync(0xffffffffu, l_run, off);
  if (sc == 0) sM[sr] = m_run, sL[sr] = l_run;
  __syncthreads();

  const int rows_real = min(BM, p.R - row0);
  const size_t tile = (size_t)b * p.RT + rt;
  int* bar = p.counters + 4 * tile;
  const unsigned gen = active > 1 && tid == 0 ? ld_relaxed(bar) : 0;
  __nv_bfloat16* out = p.out + ((size_t)b * p.R + row0) * DV;
  float* lse = p.lse + (size_t)b * p.R + row0;
  float* lp = p.lse_part + tile * p.S_max * BM;
  PartT* op = p.o_part + tile * p.S_max * BM * DV;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = m * 16 + g + hh * 8;
    if (r >= rows_real) continue;
    const float l = sL[r], inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int c = cg * 64 + n * 8 + 2 * t;
      const float2 v = make_float2(o[n][2 * hh] * inv, o[n][2 * hh + 1] * inv);
      if (active == 1)
        *reinterpret_cast<__nv_bfloat162*>(out + (size_t)r * DV + c) = __float22bfloat162_rn(v);
      else
        store_part2(op + ((size_t)split * BM + r) * DV + c, v);
    }
  }
  if (tid < rows_real) {
    const float l = sL[tid] > 0.f ? (sM[tid] + __log2f(sL[tid])) * 0.69314718055994531f : -CUDART_INF_F;
    if (active == 1)
      lse[tid] = l;
    else
      __stcg(lp + split * BM + tid, l);
  }
  if (active == 1) return;
  tile_barrier(bar, gen, active, split == 0);
  // merge_share shares its items out over THREADS (256) threads: the upper half of the block takes no part.
  if (tid < THREADS) merge_share<BM>(lp, op, out, lse, active, rows_real, split, active);
}

template <bool ROPE>
static __global__ void __launch_bounds__(W16_THREADS, 1) tree_attn_w16_kernel(Params p, Rotary rot) {
  tree_attn_w16_body<ROPE>(p, rot, blockIdx.x, blockIdx.y, blockIdx.z);
}

}  // namespace k26_attn
