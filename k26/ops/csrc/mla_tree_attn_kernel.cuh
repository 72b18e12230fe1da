// MLA tree attention v2 over the latent KV cache (absorbed MLA: one shared 576-wide key per token, values
// its first 512 dims) for DDTree verification, decode (N = 1) and DFlash chains (causal trees).
//
//   out[b, n, h] = softmax_j(scale * q[b, n, h] . K[b, j]) V[b, j],   lse[b, n, h] = log sum_j exp(...)
//   keys j: the prefix cache[rows[b], 0 .. L_b) (all visible) then the N new rows cache[rows[b], L_b + i]
//   (visible when bit i of the ancestor mask words[b, n] is set).
//   Rotary query (tree_attn_kernel<MT, true>, as the model calls it): q holds the 512 latent dims and q_pe the
//   64 rotary dims before RoPE (read in place from the q_b projection's output); q_pe is rotated by
//   positions[b, n] x inv_freq on Q in shared memory (csrc/rope.cuh, the reference's arithmetic), so the
//   model runs no RoPE + concatenation kernel per layer.
//
// One launch per call. grid = (row tiles, S splits, B): a block owns BM = 16 or 32 query rows of one sequence
// (the N*H rows, heads fastest) and one contiguous chunk of the sequence's L_b + N keys; the tree block is
// simply the end of the last chunk, masked per key. The live split count adapts on the device to the length
// (at least `min_keys` keys a split; the blocks past it leave at once), so one graph serves every context
// length; S comes from the occupancy and the SM count (k26_mla_tree_attn_plan): one wave.
//
// Per block: Q lives in registers (warp w holds rows x dims [144 (w/2), +144) as mma A fragments); keys
// stream through a 4-stage cp.async pipeline of 16-key tiles; per tile S = Q K^T is split over 8 warps
// (2 key n-tiles x 4 dim quarters, partial sums added in shared memory), the online softmax runs on all
// 256 threads (a row's 16 keys across 16 / MT lanes, reductions by shuffles), and O += P V has each warp
// owning 64 of the 512 output columns (V = the first 512 dims of the same K tile, via ldmatrix.trans).
// Software-pipelined: P V of tile i and S of tile i + 1 share a barrier interval; two barriers a tile for the
// 16-row (decode) tiles, one for the 32-row (verify) tiles (kOneBarrier, csrc/mla_attn_common.cuh). A decode
// split of at most 4 tiles (<= 64 keys: a 4K decode's 65 splits) runs as one batch instead (kBatch): S of all its
// tiles, one softmax, P V of all — two barriers a split.
//
// Split-KV merge in the same launch, one level (csrc/mla_attn_merge.cuh, finish_split): each live split writes its
// partial to the workspace, the tile's splits meet at a kernel-owned barrier, and each merges an equal share
// of the output over every split. Deferred (Params::defer_max, `mla_tree_attention_uv`: decode; with
// -DK26_ATTN_DEFER_VERIFY verify trees of up to 128 query rows too): a tile of 2..defer_max live splits only writes
// its partials; W_UV's kernel merges them (csrc/mla_merge_uv.cuh) — the barrier and the merge leave the attention's
// path.
//
// Programmatic dependent launch (csrc/pdl.cuh): launched before the query's projection has finished, every
// block issues its first prefix key tiles, waits for it, then lets W_UV's launch start (see the kernel). The
// early tiles: 4K decode 16.8 -> 13.7 µs alone, the decode step 4.70 -> 4.635 ms
// (2026-12-02-bench_tree_attn-early-keys-h200.md). Tried and dropped: the blocks prefetching o_proj's weight into
// L2 (idle splits at once, live ones after their partials) — o_proj gained 1.2 µs a layer, the attention lost 3.4
// (the prefetch queued ahead of the keys and the merge's L2 reads): the decode step 4.39 -> 4.53 ms on an H100
// (2026-12-07-l2-ahead-session40-h100.md).
//
// Legality: mma.sync.m16n8k16 bf16, ldmatrix, cp.async, griddepcontrol, ld.acquire and atomics (no warpgroup
// MMA, TMA, tensor memory or clusters); <= 99,840 B shared memory per block (Cfg; under sm_120's 101,376):
// legal on sm_120 (99 KB) and sm_90; built for sm_90a and sm_120a.
// Launch planning, workspace and the exports: csrc/mla_tree_attn.cu.
// Benchmark: profiling/bench_tree_attn.py (cold L2, graph replay; --rotary: the rotary query), results in
// profiling/results/ (the rotary query: 2026-12-01-bench_k26-rope-h200.md).

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "mla_attn_common.cuh"
#include "mla_attn_merge.cuh"
#include "pdl.cuh"

namespace k26_attn {

// ROPE: the query comes as q (512 latent dims) and rot.q_pe (rotary dims before RoPE). A template parameter,
// not a runtime branch: with the branch the plain query's kernel measured 4-7 % slower (its registers
// changed), bench_tree_attn 2026-12-01.
// The block's work for row tile rt, split `split` of sequence b (the kernel below, or the union kernel of
// csrc/mla_tree_attn_union.cuh, which maps its blocks onto this body or the wide one per sequence).
template <int MT, bool ROPE>
__device__ __forceinline__ void tree_attn_body(const Params& p, const Rotary& rot, int rt, int split, int b) {
  using C = Cfg<MT>;
  constexpr int BM = C::BM;
  constexpr int LPR = 16 / MT;  // softmax lanes per query row (MT keys each)
  extern __shared__ __align__(16) uint8_t smem[];
  const BlockSmem<MT> sm(smem);
  __nv_bfloat16* const sK = sm.sK;
  float* const sS = sm.sS;
  __nv_bfloat16* const sP = sm.sP;
  int64_t* const sWords = sm.sWords;
  float* const sAlpha = sm.sAlpha;

  TRACE(8);  // resident (trace builds: profiling/debug/attn_step_trace.py)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int row0 = rt * BM;
  // PDL: the launch and the blocks' set-up overlap the kernel before (the query's projection). That kernel
  // releases us only after its own wait (linear_smallm.cu), so every kernel before it has completed: the
  // prefix keys (cache rows below L, never written in this step) and the lengths and rows are final, and the
  // block's first prefix tiles go out before the wait, their DRAM round trip under the projection's tail.
  // The query (and the tree rows, written by the glue kernel) are read after it. Dependents (W_UV) may then
  // start streaming their weights.
  const int L = static_cast<int>(p.prefix[b]);
  const int T = live_keys(p, L);
  int chunk, active;
  split_geometry(p, T, chunk, active);
  if (split >= active) return;  // no keys for this split at this length: it takes no part in the merge
  const int k0 = split * chunk, k1 = min(T, k0 + chunk);
  const __nv_bfloat16* kv = p.cache + (size_t)p.rows[b] * p.max_len * DQK;
  const int n_tiles = (k1 - k0 + BN - 1) / BN;
  // A split of at most NSTAGE tiles runs as one batch (kBatch, csrc/mla_attn_common.cuh): all its tiles go out
  // at once (its prefix tiles before the grid-dependency wait). Otherwise the tile loop: Q is staged in the last
  // MT stages (the batch kernel's Q in the scores' region), the first NSTAGE - MT tiles beside it. One commit
  // group for all.
  const bool batch = kBatch<MT> && n_tiles <= NSTAGE;
  const int ahead = batch ? NSTAGE : NSTAGE - MT;
  __nv_bfloat16* const sQ = kBatch<MT> ? reinterpret_cast<__nv_bfloat16*>(sS) : sK + (NSTAGE - MT) * BN * LDS;
  auto issue_tile = [&](int it, __nv_bfloat16* dst) { copy_key_tile<MT>(kv, k0 + it * BN, k1, dst, tid); };
  auto early = [&](int it) { return it < n_tiles && k0 + (it + 1) * BN <= L; };  // wholly prefix keys
  for (int it = 0; it < ahead; ++it)
    if (early(it)) issue_tile(it, sK + it * BN * LDS);
  pdl_wait();
  TRACE(9);
  pdl_trigger();
  {  // With q_pe the latent dims come from q (512 per row) and the rotary ones from q_pe, rotated below.
    for (int i = tid; i < BM * CHUNK_PER_ROW; i += THREADS) {
      const int r = i / CHUNK_PER_ROW, c = (i % CHUNK_PER_ROW) * 8;
      const size_t row = (size_t)b * p.R + min(row0 + r, p.R - 1);
      const __nv_bfloat16* src = !ROPE ? p.q + row * DQK + c
                                 : c < DV ? p.q + row * DV + c
                                          : rot.q_pe + row * rot.pe_ld + (c - DV);
      cp_async16(sQ + r * LDS + c, src, row0 + r < p.R);
    }
  }
  for (int it = 0; it < ahead; ++it)
    if (it < n_tiles && !early(it)) issue_tile(it, sK + it * BN * LDS);
  cp_commit();
  RotaryPairs<ROPE, BM> rope;  // the rotary query's pairs of this thread (empty unless ROPE)
  rope.load(p, rot, b, row0, tid);
  TRACE(0);

  auto load_tile = [&](int it) {
    if (it < n_tiles) issue_tile(it, sK + (it % NSTAGE) * BN * LDS);
    cp_commit();  // always commit, so the group count per iteration stays uniform
  };

  const int nt = warp & 1, kq = warp >> 1;  // S-phase role: key n-tile, dim quarter
  uint32_t qa[MT][KSTEPS][4];
  rope.cos_sin();
  cp_wait<0>();
  __syncthreads();
  if constexpr (ROPE) {  // RoPE of the rotary dims on Q in shared memory, as the reference (reference.py: rope)
    rope.rotate(sQ, p, row0, tid);
    __syncthreads();
  }
  {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk)
        ldsm_x4(qa[m][kk], sQ + (m * 16 + (lane & 15)) * LDS + kq * 144 + kk * 16 + (lane >> 4) * 8);
  }
  __syncthreads();  // Q read: its stages (or the scores' region) may now be written
  TRACE(1);
  if (!batch)
    for (int it = NSTAGE - MT; it < NSTAGE - 1; ++it) load_tile(it);

  // Softmax role: row sr, keys sc .. sc + MT - 1 of each tile; the row's mask words.
  const int sr = tid / LPR, sc = (tid % LPR) * MT;
  stage_words<BM>(p, b, row0, sWords, tid);
  const int64_t* my_words = sWords + sr * 4;
  const Roles ro{tid, warp, lane, g, t, nt, kq, sr};
  float m_run = -CUDART_INF_F, l_run = 0.f;

  float o[MT][8][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[m][n][i] = 0.f;

  // S partial over this warp's dim quarter for keys nt*8 .. +8 of the tile in `stage` -> s, and -> sS buffer
  // `buf` when `store` (else score_store does it later).
  auto score_mma = [&](int stage, int buf, float (&s)[MT][4], bool store) {
    const __nv_bfloat16* tK = sK + stage * BN * LDS;
    // Two accumulators per m-tile (MT 2) halve the dependent-MMA chain: latency, not throughput, bounds a tile.
    float s2[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[m][i] = s2[m][i] = 0.f;
    const __nv_bfloat16* kb = tK + (nt * 8 + (lane & 7)) * LDS + kq * 144;
#pragma unroll
    for (int kk = 0; kk + 1 < KSTEPS; kk += 2) {
      uint32_t bk[4];
      ldsm_x4(bk, kb + kk * 16 + (lane >> 3) * 8);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma_bf16(s[m], qa[m][kk], bk[0], bk[1]);
        mma_bf16(MT == 1 ? s[m] : s2[m], qa[m][kk + 1], bk[2], bk[3]);  // MT 1: registers are at the cap
      }
    }
    uint32_t bl[2];
    ldsm_x2(bl, kb + (KSTEPS - 1) * 16 + ((lane >> 3) & 1) * 8);
    float* sSq = sS + buf * (KQ * BM * LDSS) + kq * BM * LDSS;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      mma_bf16(s[m], qa[m][KSTEPS - 1], bl[0], bl[1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) s[m][i] += s2[m][i];
      if (store) {
        *reinterpret_cast<float2*>(sSq + (m * 16 + g) * LDSS + nt * 8 + 2 * t) = make_float2(s[m][0], s[m][1]);
        *reinterpret_cast<float2*>(sSq + (m * 16 + g + 8) * LDSS + nt * 8 + 2 * t) = make_float2(s[m][2], s[m][3]);
      }
    }
  };
  auto score_tile = [&](int stage, int buf) {
    float s[MT][4];
    score_mma(stage, buf, s, true);
  };
  auto score_store = [&](const float (&s)[MT][4], int buf) {
    float* sSq = sS + buf * (KQ * BM * LDSS) + kq * BM * LDSS;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      *reinterpret_cast<float2*>(sSq + (m * 16 + g) * LDSS + nt * 8 + 2 * t) = make_float2(s[m][0], s[m][1]);
      *reinterpret_cast<float2*>(sSq + (m * 16 + g + 8) * LDSS + nt * 8 + 2 * t) = make_float2(s[m][2], s[m][3]);
    }
  };

  // Online softmax of the tile starting at key0: this thread's MT scores of row sr, the max over its LPR lanes
  // by shuffles; P -> sP (bf16), the rescale factor -> sAlpha. The row sum stays per lane (l_run: this lane's
  // keys, rescaled by the row's common alpha) and is reduced over the lanes once, after the key loop: the
  // per-tile shuffles of a sum the loop never reads are off the tile's critical path (4K decode 10.0 -> 9.8 µs,
  // N = 64 at 32K 272.7 -> 265.2: 2026-12-04-attn-row-sum-session18-h200.md).
  auto softmax_tile = [&](int key0, int buf) {
    float sv[MT], mx = -CUDART_INF_F;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const int key = key0 + sc + j;
      bool vis;
      if constexpr (kOneBarrier<MT>) {
        // The bit without a branch (the loop body stays one basic block); i clamped to the row's N bits.
        const int i = min(max(key - L, 0), p.N - 1);
        const int64_t w = my_words[i >> 6];
        vis = (key < k1) & ((key < L) | static_cast<bool>((w >> (i & 63)) & 1));
      } else {
        vis = key < k1;
        if (vis && key >= L) {
          const int i = key - L;
          vis = (my_words[i >> 6] >> (i & 63)) & 1;
        }
      }
      float acc = 0.f;
#pragma unroll
      for (int q4 = 0; q4 < KQ; ++q4) acc += sS[buf * (KQ * BM * LDSS) + (q4 * BM + sr) * LDSS + sc + j];
      sv[j] = vis ? acc * p.scale_log2 : -CUDART_INF_F;
      mx = fmaxf(mx, sv[j]);
    }
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
#ifdef K26_ATTN_LAZY_RESCALE
    // The running max moves only when the tile's max exceeds it by more than 8 (log2 units): P <= 2^8 then (fp32
    // sums and bf16 P are fine with that), alpha stays exactly 1 for most tiles, and pv_tile skips O's rescale.
    // The decision is the row's own (mx and m_run agree across its lanes). Not bit-identical to the eager max.
    const float m_new = mx - m_run > 8.f ? mx : m_run;  // m_run = -inf: the tile's max (or -inf, all masked)
#else
    const float m_new = fmaxf(m_run, mx);
#endif
    float alpha = 1.f, sum = 0.f;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const float pj = m_new == -CUDART_INF_F ? 0.f : exp2f(sv[j] - m_new);
      sP[buf * (BM * LDP) + sr * LDP + sc + j] = __float2bfloat16(pj);
      sum += pj;  // unrounded, as FlashAttention does: keeps the log-sum-exp fp32-accurate
    }
    if (m_new != -CUDART_INF_F) alpha = exp2f(m_run - m_new);  // 0 when m_run is -inf
    l_run = l_run * alpha + sum;
    m_run = m_new;
    if (tid % LPR == 0) sAlpha[buf * BM + sr] = alpha;
  };

  // O = alpha * O + P V, V = the tile in `stage`.
  auto pv_tile = [&](int stage, int buf) {
    const __nv_bfloat16* tK = sK + stage * BN * LDS;
    uint32_t pa[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float al0 = sAlpha[buf * BM + m * 16 + g], al1 = sAlpha[buf * BM + m * 16 + g + 8];
#ifdef K26_ATTN_LAZY_RESCALE
      const bool rescale = al0 != 1.f || al1 != 1.f;
#else
      constexpr bool rescale = true;
#endif
      if (rescale) {
#pragma unroll
        for (int n = 0; n < 8; ++n) o[m][n][0] *= al0, o[m][n][1] *= al0, o[m][n][2] *= al1, o[m][n][3] *= al1;
      }
      ldsm_x4(pa[m], sP + buf * (BM * LDP) + (m * 16 + (lane & 15)) * LDP + (lane >> 4) * 8);
    }
    pv_mma<MT>(o, tK, pa, lane, warp);
  };

  // One batch (kBatch): the split's n <= NSTAGE tiles, all landed with Q. Scores of every tile (independent MMA
  // chains, this warp's key n-tile and dim quarter) -> the batch's partial scores; one barrier; the softmax of
  // the split's <= 64 keys (this thread: row sr, keys 4 (tid % 16) .. + 3 of the batch; the row's max over its 16
  // lanes by shuffles) -> P; one barrier; P V of every tile. No running max to rescale: O starts here. The lane
  // roles (sr, 16 lanes a row) are the tile loop's, so the epilogue's row sums are the same code.
  auto batch_split = [&](int n) {
    if constexpr (kBatch<MT>) {
      static_assert(MT == 1 && LPR == 16 && NSTAGE * BN == 4 * LPR, "a row's 64 keys: 16 lanes, 4 each");
      float sb[NSTAGE][4];
#pragma unroll
      for (int j = 0; j < NSTAGE; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) sb[j][i] = 0.f;
      const __nv_bfloat16* kb = sK + (nt * 8 + (lane & 7)) * LDS + kq * 144;
#pragma unroll
      for (int kk = 0; kk + 1 < KSTEPS; kk += 2)
#pragma unroll
        for (int j = 0; j < NSTAGE; ++j) {
          if (j >= n) continue;  // uniform: a stage without a tile of this split is never read
          uint32_t bk[4];
          ldsm_x4(bk, kb + j * BN * LDS + kk * 16 + (lane >> 3) * 8);
          mma_bf16(sb[j], qa[0][kk], bk[0], bk[1]);
          mma_bf16(sb[j], qa[0][kk + 1], bk[2], bk[3]);
        }
      float* sSq = sS + kq * BM * LDSB;
#pragma unroll
      for (int j = 0; j < NSTAGE; ++j) {
        if (j >= n) continue;
        uint32_t bl[2];
        ldsm_x2(bl, kb + j * BN * LDS + (KSTEPS - 1) * 16 + ((lane >> 3) & 1) * 8);
        mma_bf16(sb[j], qa[0][KSTEPS - 1], bl[0], bl[1]);
        *reinterpret_cast<float2*>(sSq + g * LDSB + j * BN + nt * 8 + 2 * t) = make_float2(sb[j][0], sb[j][1]);
        *reinterpret_cast<float2*>(sSq + (g + 8) * LDSB + j * BN + nt * 8 + 2 * t) = make_float2(sb[j][2], sb[j][3]);
      }
      __syncthreads();  // the partial scores (and the rows' mask words) visible
      const int c0 = (tid % LPR) * 4;
      float4 acc = *reinterpret_cast<const float4*>(sS + sr * LDSB + c0);
#pragma unroll
      for (int q4 = 1; q4 < KQ; ++q4) {
        const float4 a = *reinterpret_cast<const float4*>(sS + (q4 * BM + sr) * LDSB + c0);
        acc.x += a.x, acc.y += a.y, acc.z += a.z, acc.w += a.w;
      }
      const float a4[4] = {acc.x, acc.y, acc.z, acc.w};
      float sv[4], mx = -CUDART_INF_F;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = k0 + c0 + j;
        bool vis = key < k1;
        if (vis && key >= L) {
          const int i = key - L;
          vis = (my_words[i >> 6] >> (i & 63)) & 1;
        }
        sv[j] = vis ? a4[j] * p.scale_log2 : -CUDART_INF_F;
        mx = fmaxf(mx, sv[j]);
      }
#pragma unroll
      for (int off = LPR / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      float pj[4], sum = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pj[j] = mx == -CUDART_INF_F ? 0.f : exp2f(sv[j] - mx);
        sum += pj[j];  // unrounded, as the tile loop's
      }
      __nv_bfloat162* pp = reinterpret_cast<__nv_bfloat162*>(sP + sr * LDPB + c0);
      pp[0] = __floats2bfloat162_rn(pj[0], pj[1]);
      pp[1] = __floats2bfloat162_rn(pj[2], pj[3]);
      l_run = sum, m_run = mx;
      __syncthreads();  // P visible
#pragma unroll
      for (int j = 0; j < NSTAGE; ++j) {
        if (j >= n) continue;
        uint32_t pa[MT][4];
        ldsm_x4(pa[0], sP + (lane & 15) * LDPB + j * BN + (lane >> 4) * 8);
        pv_mma<MT>(o, sK + j * BN * LDS, pa, lane, warp);
      }
    }
  };

  // Software-pipelined (either body): P V of one tile and S of the next are independent, so their MMAs overlap;
  // tile 0's S and softmax run ahead of the loop (tile 0 landed with Q).
  if constexpr (kOneBarrier<MT>) {
    // One barrier a tile: interval k runs the softmax of tile k (scores from sS buffer k & 1 -> P, alpha buffer
    // k & 1), S of tile k + 1 (-> sS buffer (k + 1) & 1) and P V of tile k - 1 (P, alpha buffer (k - 1) & 1), all
    // independent, in one basic block the compiler interleaves (the softmax's shuffle / exp2 latency under the
    // MMA chains). Tile k is read in intervals k - 1 (S) and k + 1 (P V), so the 4 stages hold tiles k - 1 .. k + 2:
    // tile k + 2 goes out in interval k into the stage of tile k - 2 and has one interval to land.
    // Same arithmetic in the same order as the default: bit-identical.
    static_assert(NSTAGE == 4, "stages of tiles k - 1 .. k + 2");
    score_tile(0, 0);
    cp_wait<1>();  // tile 1 landed (tile 2 may still be in flight)
    __syncthreads();
    softmax_tile(k0, 0);
    score_tile(1, 1);  // n_tiles 1: a stale stage; unused
    for (int k = 1; k < n_tiles; ++k) {
      cp_wait<0>();     // tile k + 1 landed
      __syncthreads();  // S(k), P(k - 1) visible; interval k - 1 done everywhere: tile k - 2's stage is free
      issue_tile(k + 2, sK + ((k + 2) % NSTAGE) * BN * LDS);  // past the last tile: zero-fills, no reads
      cp_commit();
      pv_tile((k - 1) % NSTAGE, (k - 1) & 1);
      float s[MT][4];
      score_mma((k + 1) % NSTAGE, (k + 1) & 1, s, false);  // past the last tile a stale stage; the result is unused
      softmax_tile(k0 + k * BN, k & 1);
      score_store(s, (k + 1) & 1);  // after the softmax's loads of the other buffer: the compiler keeps the order
    }
    __syncthreads();
    pv_tile((n_tiles - 1) % NSTAGE, (n_tiles - 1) & 1);
  } else if (batch) {
    batch_split(n_tiles);
  } else {
    // Two barriers a tile: P V of tile `it` and S of tile `it + 1` between them, the softmax of `it + 1` after.
    score_tile(0, 0);
    __syncthreads();
    softmax_tile(k0, 0);
    for (int it = 0; it < n_tiles; ++it) {
      cp_wait<NSTAGE - 3>();  // tile it + 1 landed
      __syncthreads();        // P(it) visible; everyone finished tile it - 1, so its stage is free
      load_tile(it + NSTAGE - 1);
      pv_tile(it % NSTAGE, 0);
      score_tile((it + 1) % NSTAGE, 0);  // past the last tile this scores a stale stage; the result is unused
      __syncthreads();
      if (it + 1 < n_tiles) softmax_tile(k0 + (it + 1) * BN, 0);
    }
  }
  TRACE(2);
  cp_wait<0>();  // no copy may land in shared memory after the block exits

  finish_split<MT>(p, sm, ro, o, m_run, l_run, rt, split, b, active);
}

// Two 16-row blocks an SM where they fit (sm_90: 2 x 96 KB); on sm_120 (100 KB an SM) one, so no register cap
// for a second (124 -> 130 registers, sm_120a).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kMinBlocks16 = 1;
#else
constexpr int kMinBlocks16 = 2;
#endif
template <int MT, bool ROPE>
static __global__ void __launch_bounds__(THREADS, MT == 1 ? kMinBlocks16 : 1)
    tree_attn_kernel(Params p, Rotary rot) {
  tree_attn_body<MT, ROPE>(p, rot, blockIdx.x, blockIdx.y, blockIdx.z);
}

}  // namespace k26_attn
