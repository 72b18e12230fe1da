// Shared pieces of the MLA tree-attention kernel (csrc/mla_tree_attn_kernel.cuh, csrc/mla_attn_merge.cuh): tile
// geometry and shared-memory layout (Cfg), the launch parameters, the split geometry every block of a sequence
// agrees on, and the -DK26_ATTN_TRACE phase stamps (the cp.async / ldmatrix / mma.sync wrappers:
// csrc/warp_mma.cuh).
//
// Legality: mma.sync.m16n8k16 bf16, ldmatrix, cp.async (sm_80+): sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "globaltimer.cuh"
#include "rope.cuh"
#include "warp_mma.cuh"

// Phase timestamps for profiling/debug/attn_trace.py (built with -DK26_ATTN_TRACE; absent otherwise).
#ifdef K26_ATTN_TRACE
__device__ unsigned long long g_attn_trace[1024][16];
#define TRACE(k)                                                                       \
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.z == 0 && blockIdx.y < 1024) \
    g_attn_trace[blockIdx.y][k] = k26_globaltimer();
#else
#define TRACE(k)
#endif

namespace k26_attn {

constexpr int DQK = 576, DV = 512;
constexpr int BN = 16;            // keys per tile
constexpr int NSTAGE = 4;         // cp.async stages of 18.7 KB: three tiles in flight during compute
constexpr int THREADS = 256;      // 8 warps
constexpr int LDS = DQK + 8;      // padded smem row, 1168 B: ldmatrix rows land on distinct banks
constexpr int KQ = 4;             // dim quarters of the S = Q K^T product (144 dims = 9 k-steps each)
constexpr int KSTEPS = DQK / 16 / KQ;
constexpr int LDSS = BN + 4;      // fp32 partial-score row
constexpr int LDP = BN + 8;       // bf16 P row (48 B: 16-B aligned rows for ldmatrix)
constexpr int CHUNK_PER_ROW = DQK / 8;  // 16-byte chunks per cache row
constexpr size_t cmax(size_t a, size_t b) { return a > b ? a : b; }

// The key-loop body each row-tile kernel runs (mla_tree_attn_kernel.cuh), chosen per MT at compile time, so
// the launch's tile choice (tile_rows: N x H) picks it: bit j of a mask set for MT = j + 1. One barrier a tile
// (two buffers each of the partial scores, P and alpha) and row copies (each warp copies two whole keys) help
// the 32-row verify tiles; one barrier costs the 16-row decode ones. Measured on an H200, cold L2: one barrier
// N = 16 / 64 at 32K 76.8 -> 65.7 / 266 -> 223 µs, N = 1 9.9 -> 10.7 at 4K (2026-12-05-variants-session20-h200.md);
// row copies on top 64.9 -> 63.5 / 217 -> 209, N = 16 at 4K 19.0 -> 18.7 (2026-12-05-attn-tiles-session21-h200.md).
#ifndef K26_ATTN_ONE_BARRIER_MT
#define K26_ATTN_ONE_BARRIER_MT 2
#endif
#ifndef K26_ATTN_ROW_COPIES_MT
#define K26_ATTN_ROW_COPIES_MT 2
#endif
template <int MT>
constexpr bool kOneBarrier = (K26_ATTN_ONE_BARRIER_MT >> (MT - 1)) & 1;
template <int MT>
constexpr bool kRowCopies = (K26_ATTN_ROW_COPIES_MT >> (MT - 1)) & 1;

// The decode tiles (MT 1) take a split of at most NSTAGE tiles (64 keys: up to 16K decode's) in one batch: the
// scores of every tile, one softmax, P V of every tile — two barriers a split where the tile loop has two a tile
// (mla_tree_attn_kernel.cuh). Its Q is staged in the scores' region, so every prefix tile can go out before the
// grid-dependency wait (tiles with new tree keys go out after it, as in the tile loop). Longer splits keep the
// tile loop: batches of four tiles for them too (the next batch's tiles issued into the freed stages, its DRAM
// round trip exposed) measured slower at 32K / 128K and, in the same kernel, at 4K as well (H100: 27.6 -> 30.9 /
// 68.7 -> 74.5 µs; 2026-12-06-attn-decode-batch-session33-h100.md).
// Measured (same file): 4K decode 10.4 -> 9.0 µs, 1K 8.8 -> 7.4, 8K 14.0 -> 12.8; 32K / 128K 27.6 / 68.7 ->
// 27.9 / 70.1 (the larger shared memory). -DK26_ATTN_NO_BATCH: the tile loop for every split (the A/B side).
#ifdef K26_ATTN_NO_BATCH
template <int MT>
constexpr bool kBatch = false;
#else
template <int MT>
constexpr bool kBatch = MT == 1 && !kOneBarrier<MT>;  // (the batch stands in for the two-barrier tile loop)
#endif
constexpr int LDSB = NSTAGE * BN + 4;  // a batch's fp32 partial-score row (16-B aligned rows for float4 reads)
constexpr int LDPB = NSTAGE * BN + 8;  // a batch's bf16 P row (16-B aligned rows for ldmatrix)

template <int MT>
struct Cfg {
  static constexpr int SBUF = kOneBarrier<MT> ? 2 : 1;
  static constexpr int BM = 16 * MT;
  static constexpr size_t K = (size_t)NSTAGE * BN * LDS * 2;
  static constexpr size_t S1 = (size_t)KQ * BM * LDSS * 4;  // one buffer
  static constexpr size_t QS = (size_t)BM * LDS * 2;        // Q staged (a batch kernel's Q: in this region)
  static constexpr size_t SB = (size_t)KQ * BM * LDSB * 4;  // a batch's partial scores
  static constexpr size_t S = kBatch<MT> ? cmax(cmax(SBUF * S1, SB), QS) : SBUF * S1;  // all buffers
  static constexpr size_t P1 = (size_t)BM * LDP * 2;
  static constexpr size_t P = kBatch<MT> ? cmax(SBUF * P1, (size_t)BM * LDPB * 2) : SBUF * P1;
  static constexpr size_t WORDS = (size_t)BM * 4 * 8;  // each row's ancestor words (<= 4: N <= 256)
  static constexpr size_t SMEM = K + S + P + WORDS + (SBUF + 2) * BM * 4;
  static_assert(SMEM <= 101376, "sm_120 allows at most 99 KB of shared memory per block");
  static_assert(QS <= (size_t)MT * BN * LDS * 2, "Q staging must fit MT stages");
  static_assert(K % 16 == 0 && S % 16 == 0 && P % 16 == 0, "16-B aligned regions (ldmatrix, float4)");
};

// The block's dynamic shared memory as Cfg<MT> sizes it: key stages | partial scores ([KQ][BM][LDSS]; the batch:
// Q staged here first, then [KQ][BM][LDSB]) | P | each row's mask words ([BM][4]) | alpha | row max m | row sum l.
template <int MT>
struct BlockSmem {
  using C = Cfg<MT>;
  __nv_bfloat16* sK;
  float* sS;
  __nv_bfloat16* sP;
  int64_t* sWords;
  float *sAlpha, *sM, *sL;
  __device__ __forceinline__ explicit BlockSmem(uint8_t* smem)
      : sK(reinterpret_cast<__nv_bfloat16*>(smem)),
        sS(reinterpret_cast<float*>(smem + C::K)),
        sP(reinterpret_cast<__nv_bfloat16*>(smem + C::K + C::S)),
        sWords(reinterpret_cast<int64_t*>(smem + C::K + C::S + C::P)),
        sAlpha(reinterpret_cast<float*>(smem + C::K + C::S + C::P + C::WORDS)),
        sM(sAlpha + C::SBUF * C::BM),
        sL(sM + C::BM) {}
};

// A thread's place in the block (tree_attn_body): tid, warp, lane, the mma fragments' row group g and thread t
// in it, the S phase's key n-tile nt and dim quarter kq, the softmax's row sr. Passed to the body's helpers, not
// recomputed from threadIdx there: recomputed, ptxas scheduled the 32-row kernel differently (its SASS changed).
struct Roles {
  int tid, warp, lane, g, t, nt, kq, sr;
};

// One 16-key tile of the cache row kv (keys key0 .. key0 + 15, those from k1 on zero-filled) into dst by cp.async.
template <int MT>
__device__ __forceinline__ void copy_key_tile(const __nv_bfloat16* kv, int key0, int k1, __nv_bfloat16* dst,
                                              int tid) {
  if constexpr (kRowCopies<MT>) {
    // Warp w copies keys 2w and 2w + 1 (144 16-byte chunks: lane l takes chunks l + 32 k of the pair, k = 0..4,
    // the last only for l < 16), so each copy's row and column follow from the lane without the division by
    // 72 of the strided loop below, whose address arithmetic is about a third of the MT 1 key loop's
    // instructions (PTX count).
    static_assert(BN == 2 * (THREADS / 32) && CHUNK_PER_ROW == 72, "two keys of 72 chunks a warp");
    const int lane = tid & 31, r0 = 2 * (tid >> 5);
    const bool v0 = key0 + r0 < k1, v1 = key0 + r0 + 1 < k1;
    const __nv_bfloat16* s0 = kv + (size_t)min(key0 + r0, k1 - 1) * DQK;
    const __nv_bfloat16* s1 = kv + (size_t)min(key0 + r0 + 1, k1 - 1) * DQK;
    __nv_bfloat16 *d0 = dst + r0 * LDS, *d1 = d0 + LDS;
    const int c = lane * 8;
    cp_async16(d0 + c, s0 + c, v0);              // key 2w, chunks 0-31
    cp_async16(d0 + c + 256, s0 + c + 256, v0);  // chunks 32-63
    const bool a = lane < 8;                     // chunks 64-71 of key 2w, or 0-23 of key 2w + 1
    cp_async16(a ? d0 + c + 512 : d1 + c - 64, a ? s0 + c + 512 : s1 + c - 64, a ? v0 : v1);
    cp_async16(d1 + c + 192, s1 + c + 192, v1);  // key 2w + 1, chunks 24-55
    if (lane < 16) cp_async16(d1 + c + 448, s1 + c + 448, v1);  // chunks 56-71
  } else if constexpr (kOneBarrier<MT>) {
    // The strided copies unrolled (the last one predicated): no loop, so the one-barrier key loop's body stays
    // one basic block that the compiler can interleave.
#pragma unroll
    for (int j = 0; j < (BN * CHUNK_PER_ROW + THREADS - 1) / THREADS; ++j) {
      const int i = tid + j * THREADS;
      const int r = i / CHUNK_PER_ROW, c = (i % CHUNK_PER_ROW) * 8;
      const int key = min(key0 + r, k1 - 1);
      if (i < BN * CHUNK_PER_ROW) cp_async16(dst + r * LDS + c, kv + (size_t)key * DQK + c, key0 + r < k1);
    }
  } else {
    for (int i = tid; i < BN * CHUNK_PER_ROW; i += THREADS) {
      const int r = i / CHUNK_PER_ROW, c = (i % CHUNK_PER_ROW) * 8;
      const int key = min(key0 + r, k1 - 1);
      cp_async16(dst + r * LDS + c, kv + (size_t)key * DQK + c, key0 + r < k1);
    }
  }
}

// The splits' o partials in the workspace are fp32. (bf16 partials — half the bytes written before the merge's
// barrier and read after it — measured slower on every shape and missed the 3e-3 bound on one test:
// profiling/results/2026-12-04-variants-session17-h200.md. The merge is latency-, not byte-bound.)
using PartT = float;

__device__ __forceinline__ void store_part2(float* p, float2 v) { __stcg(reinterpret_cast<float2*>(p), v); }
__device__ __forceinline__ float4 load_part4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }

struct Params {
  const __nv_bfloat16* q;      // [B, N, H, 576], or [B, N, H, 512] with a Rotary query part
  const __nv_bfloat16* cache;  // [cache rows, max_len, 576]
  const int64_t* rows;         // [B]
  const int64_t* prefix;       // [B]
  const int64_t* words;        // [B, N, W]
  __nv_bfloat16* out;          // [B, N, H, 512]
  float* lse;                  // [B, N, H]
  int* counters;               // [B, RT, 4]  each row tile's merge barrier (csrc/mla_attn_merge.cuh)
  float* lse_part;             // [B, RT, S_max, BM]  each split's lse
  PartT* o_part;               // [B, RT, S_max, BM, 512]  each split's normalised partial
  int N, H, W, R, RT, max_len, S_max, min_keys;
  float scale_log2;  // softmax scale * log2(e): scores live in the exp2 domain
  // A tile (of at most 16 kDeferMT rows) whose live split count lies in (1, defer_max] stores its partials and
  // leaves: the merge runs in the next kernel (csrc/mla_merge_uv.cuh). 0: every tile merges here.
  int defer_max;
};

// The row tiles that may defer their merge to W_UV's kernel: the 16-row (decode) tiles; built with
// -DK26_ATTN_DEFER_VERIFY also the 32-row (verify) tiles, up to 128 query rows a sequence (an A/B side until
// measured: k26/ops/build.py VARIANTS; the front door reads the bound from k26_mla_merge_uv_defers_verify).
#ifdef K26_ATTN_DEFER_VERIFY
constexpr int kDeferMT = 2;
#else
constexpr int kDeferMT = 1;
#endif

// The query's rotary part apart from q (tree_attn_kernel<MT, true>): a second kernel argument, not fields of
// Params, whose local copy the kernel keeps (Params grown by these 32 bytes cost the plain query's kernel
// 4-7 %, bench_tree_attn 2026-12-01).
struct Rotary {
  const __nv_bfloat16* q_pe;  // row (b, n, h) at + ((b N + n) H + h) pe_ld: the rotary dims before RoPE
  const int64_t* positions;   // [B, N]
  const float* inv_freq;      // [32] (interleaved pairs)
  long long pe_ld;
};

// Split geometry, identical in every block of a sequence: chunk (keys per split, a multiple of BN) and
// the active split count for T = live keys.
__device__ __forceinline__ void split_geometry(const Params& p, int T, int& chunk, int& active) {
  const int want = max(1, min(p.S_max, (T + p.min_keys - 1) / p.min_keys));
  chunk = ((T + want - 1) / want + BN - 1) / BN * BN;
  active = (T + chunk - 1) / chunk;
}

// Live keys of a sequence with prefix L: the prefix and the N new rows (at least 1), clamped to the cache row
// (inside a graph reads are clamped; outside it the front door refuses such lengths). The union kernel's choice
// of body and both bodies' splits use this one value.
__device__ __forceinline__ int live_keys(const Params& p, int L) { return max(1, min(L + p.N, p.max_len)); }

// Each of the block's ROWS rows' ancestor words into shared memory ([ROWS][4]): no global pointer stays live
// through the key loop.
template <int ROWS>
__device__ __forceinline__ void stage_words(const Params& p, int b, int row0, int64_t* sWords, int tid) {
  for (int i = tid; i < ROWS * p.W; i += THREADS) {
    const int r = i / p.W;
    sWords[r * 4 + i % p.W] = p.words[((size_t)b * p.N + min(row0 + r, p.R - 1) / p.H) * p.W + i % p.W];
  }
}

// cosf / sinf out of line: inlined, their rarely taken large-argument path (a local array) changed the whole
// kernel's code and cost the N = 16 / 64 rotary kernel 6 % (bench_tree_attn --rotary, 2026-12-01: 100.6 vs
// 95.1 µs at N = 16, L = 32K; __sincosf measured like the out-of-line call, but is not the reference's value).
static __device__ __noinline__ float2 rope_cos_sin(int64_t position, float inv_freq) {
  return k26_rope_cos_sin(position, inv_freq);
}

// One thread's share of a block's rotary query pairs (row r, pair j; BM rows x 32 pairs over the block's
// threads): `load` their positions and frequencies beside Q, `cos_sin` once the first key tiles are issued
// (just before the wait, so neither the loads nor the sincos add a step to the block's path), `rotate` Q's
// rotary dims in shared memory after it. Measured cost of the rotary query: +0.7 µs at N = 1, L = 4K; within
// 1 % at L = 32K (2026-12-01-bench_k26-rope-h200.md). ROPE = false: empty, nothing runs.
template <bool ROPE, int BM>
struct RotaryPairs {
  static constexpr int PAIRS = (DQK - DV) / 2, ITEMS = ROPE ? (BM * PAIRS + THREADS - 1) / THREADS : 1;
  int64_t pos[ITEMS];
  float freq[ITEMS];
  float2 cs[ITEMS];

  __device__ __forceinline__ void load(const Params& p, const Rotary& rot, int b, int row0, int tid) {
    if constexpr (ROPE) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int i = tid + k * THREADS, r = i / PAIRS;
        const bool live = i < BM * PAIRS && row0 + r < p.R;
        pos[k] = live ? rot.positions[(size_t)b * p.N + (row0 + r) / p.H] : 0;
        freq[k] = live ? __ldg(rot.inv_freq + i % PAIRS) : 0.f;
      }
    }
  }
  __device__ __forceinline__ void cos_sin() {
    if constexpr (ROPE) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) cs[k] = rope_cos_sin(pos[k], freq[k]);
    }
  }
  // sQ: the block's staged Q rows (LDS apart); the caller synchronises the block before and after.
  __device__ __forceinline__ void rotate(__nv_bfloat16* sQ, const Params& p, int row0, int tid) {
    if constexpr (ROPE) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int i = tid + k * THREADS;
        if (i >= BM * PAIRS || row0 + i / PAIRS >= p.R) continue;
        __nv_bfloat162* x = reinterpret_cast<__nv_bfloat162*>(sQ + (i / PAIRS) * LDS + DV) + i % PAIRS;
        *x = k26_rope_rotate(*x, cs[k]);
      }
    }
  }
};

// O += P V over this warp's 64 output columns: P's A fragments pa, V = the first 512 dims of the key tile tK.
template <int MT>
__device__ __forceinline__ void pv_mma(float (&o)[MT][8][4], const __nv_bfloat16* tK, const uint32_t (&pa)[MT][4],
                                       int lane, int warp) {
#pragma unroll
  for (int n2 = 0; n2 < 4; ++n2) {
    uint32_t vb[4];
    ldsm_x4_t(vb, tK + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + warp * 64 + n2 * 16 + (lane >> 4) * 8);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      mma_bf16(o[m][2 * n2], pa[m], vb[0], vb[1]);
      mma_bf16(o[m][2 * n2 + 1], pa[m], vb[2], vb[3]);
    }
  }
}

}  // namespace k26_attn
