// MLA tree attention v2 over the latent KV cache (absorbed MLA: one shared 576-wide key per token, values
// its first 512 dims) for DDTree verification, decode (N = 1) and DFlash chains (causal trees).
//
//   out[b, n, h] = softmax_j(scale * q[b, n, h] . K[b, j]) V[b, j],   lse[b, n, h] = log sum_j exp(...)
//   keys j: the prefix cache[rows[b], 0 .. L_b) (all visible) then the N new rows cache[rows[b], L_b + i]
//   (visible when bit i of the ancestor mask words[b, n] is set).
//
// One launch per call. grid = (row tiles, S splits, B) in clusters of CL <= 8 splits: a block owns BM = 16
// or 32 query rows of one sequence (the N*H rows, heads fastest) and one contiguous chunk of the
// sequence's L_b + N keys; the tree block is simply the end of the last chunk, masked per key. The live
// split count adapts on the device to the length (at least `min_keys` keys a split), so one graph serves
// every context length; S and CL come from the occupancy and the SM count (k26_mla_tree_attn_plan).
//
// Per block: Q lives in registers (warp w holds rows x dims [144 (w/2), +144) as mma A fragments); keys
// stream through a 4-stage cp.async pipeline of 16-key tiles; per tile S = Q K^T is split over 8 warps
// (2 key n-tiles x 4 dim quarters, partial sums added in shared memory), the online softmax runs on all
// 256 threads (a row's 16 keys across 16 / MT lanes, reductions by shuffles), and O += P V has each warp
// owning 64 of the 512 output columns (V = the first 512 dims of the same K tile, via ldmatrix.trans).
// Software-pipelined: P V of tile i and S of tile i + 1 share one barrier interval, so two barriers a tile.
//
// Split-KV merge in the same launch (details at merge_weights): the splits of a cluster reduce their
// partials through distributed shared memory, each block a column slice; clusters then meet in the
// workspace, where the last to arrive merges them, again one column slice a block.
//
// Legality: mma.sync.m16n8k16 bf16, ldmatrix, cp.async, thread-block clusters of <= 8 with distributed
// shared memory (sm_90 and sm_120 both have them; no warpgroup MMA, TMA or tensor memory); <= 88 KB shared
// memory per block: legal on sm_120 (99 KB) and sm_90; built for sm_90a and sm_120a.
// Benchmark: profiling/bench_tree_attn.py (cold L2, graph replay), results in profiling/results/.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

// Phase timestamps for profiling/debug/attn_trace.py (built with -DK26_ATTN_TRACE; absent otherwise).
#ifdef K26_ATTN_TRACE
__device__ unsigned long long g_attn_trace[1024][16];
#define TRACE(k)                                                                                   \
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.z == 0 && blockIdx.y < 1024) {             \
    unsigned long long t_;                                                                         \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                         \
    g_attn_trace[blockIdx.y][k] = t_;                                                              \
  }
#else
#define TRACE(k)
#endif

namespace {

namespace cg = cooperative_groups;
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

template <int MT>
struct Cfg {
  static constexpr int BM = 16 * MT;
  static constexpr size_t K = (size_t)NSTAGE * BN * LDS * 2;
  static constexpr size_t S = (size_t)KQ * BM * LDSS * 4;
  static constexpr size_t P = (size_t)BM * LDP * 2;
  static constexpr size_t WORDS = (size_t)BM * 4 * 8;  // each row's ancestor words (<= 4: N <= 256)
  static constexpr size_t SMEM = K + S + P + WORDS + 3 * BM * 4;
  static_assert(SMEM <= 101376, "sm_120 allows at most 99 KB of shared memory per block");
  static_assert((size_t)BM * LDS * 2 <= (size_t)MT * BN * LDS * 2, "Q staging must fit MT stages");
  static_assert(S >= (size_t)(32 + 1) * BM * 4, "the merge's weights reuse the score buffer");
};

struct Params {
  const __nv_bfloat16* q;      // [B, N, H, 576]
  const __nv_bfloat16* cache;  // [cache rows, max_len, 576]
  const int64_t* rows;         // [B]
  const int64_t* prefix;       // [B]
  const int64_t* words;        // [B, N, W]
  __nv_bfloat16* out;          // [B, N, H, 512]
  float* lse;                  // [B, N, H]
  int* counters;               // [B, RT]   zero at rest
  float* lse_part;             // [B, RT, S_max / CL, BM]      one partial per cluster
  float* o_part;               // [B, RT, S_max / CL, BM, 512]
  int N, H, W, R, RT, max_len, S_max, CL, min_keys;
  float scale_log2;  // softmax scale * log2(e): scores live in the exp2 domain
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N_>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N_)); }

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x2(uint32_t r[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Split geometry, identical in every block of a sequence: chunk (keys per split, a multiple of BN) and
// the active split count for T = live keys.
__device__ __forceinline__ void split_geometry(const Params& p, int T, int& chunk, int& active) {
  const int want = max(1, min(p.S_max, (T + p.min_keys - 1) / p.min_keys));
  chunk = ((T + want - 1) / want + BN - 1) / BN * BN;
  active = (T + chunk - 1) / chunk;
}

// Split-KV merge, in two steps and without a second launch:
// 1. Within a thread-block cluster of CL splits (CL <= 8, along grid y): each block leaves its normalised
//    partial (o, lse) in its own shared memory; after a cluster barrier block q reduces output columns
//    [q * 512 / CL, +512 / CL) over the CL partials through distributed shared memory. The reduction is
//    spread over CL SMs and never touches global memory.
// 2. Across clusters: each block writes its column slice of the cluster's partial to the workspace; the
//    last cluster to arrive (an atomic counter per row tile, reset by that cluster, so graph replays need
//    no memset) merges every cluster's partial, each of its blocks again for its own column slice.
// Both steps run in a fixed order, so results are deterministic.
constexpr int LDO = DV + 4;  // fp32 partial row in shared memory (padded against bank conflicts)
#ifndef MERGE_LOADS
#define MERGE_LOADS 12  // float4 loads in flight per thread in the global merge
#endif

// Weights of `n` partials for each of `rows` rows into sw[k * BM + r] (normalised to sum 1) and the merged
// lse into slse[r]. The n * rows lse values (load(k, r)) are fetched by all threads at once, so a merge
// pays one memory round trip for them, not n; then one thread per row reduces them.
template <int BM, class Load>
__device__ __forceinline__ void merge_weights(int n, int rows, Load load, float* sw, float* slse) {
  for (int i = threadIdx.x; i < n * rows; i += THREADS) sw[(i / rows) * BM + i % rows] = load(i / rows, i % rows);
  __syncthreads();
  const int r = threadIdx.x;
  if (r < rows) {
    float mx = -CUDART_INF_F, wsum = 0.f;
    for (int k = 0; k < n; ++k) mx = fmaxf(mx, sw[k * BM + r]);
    for (int k = 0; k < n; ++k) {
      const float w = mx == -CUDART_INF_F ? 0.f : __expf(sw[k * BM + r] - mx);  // 0 for an empty partial
      sw[k * BM + r] = w, wsum += w;
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    for (int k = 0; k < n; ++k) sw[k * BM + r] *= inv;
    slse[r] = wsum > 0.f ? mx + __logf(wsum) : -CUDART_INF_F;
  }
  __syncthreads();
}

// Stores four merged columns of row r: bf16 into out (the final result) or fp32 into part.
__device__ __forceinline__ void store4(__nv_bfloat16* out, float* part, int r, int c, float4 v) {
  if (out) {
    __nv_bfloat16* o = out + (size_t)r * DV + c;
    *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v.x, v.y);
    *reinterpret_cast<__nv_bfloat162*>(o + 2) = __floats2bfloat162_rn(v.z, v.w);
  } else {
    __stcg(reinterpret_cast<float4*>(part + (size_t)r * DV + c), v);
  }
}

// Step 2 of the merge, in the last cluster: columns [c0, c0 + W) of the final output from the clusters'
// partials. Not inlined: the kernel's register budget (MT 1: 128) then need not hold it.
template <int BM>
__device__ __noinline__ void merge_clusters(const float* lp, const float* op, __nv_bfloat16* out, float* lse,
                                            int clusters, int rows_real, int c0, int W, float* sw) {
  float* slse = sw + clusters * BM;  // sw: [clusters][BM] weights in the (free) key stages
  merge_weights<BM>(clusters, rows_real, [&](int k, int r) { return __ldcg(lp + k * BM + r); }, sw, slse);
  for (int item = threadIdx.x; item < rows_real * (W / 4); item += THREADS) {
    const int r = item / (W / 4), c = c0 + (item % (W / 4)) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k0 = 0; k0 < clusters; k0 += MERGE_LOADS) {
      float4 v[MERGE_LOADS];
#pragma unroll
      for (int k = 0; k < MERGE_LOADS; ++k)
        if (k0 + k < clusters) v[k] = __ldcg(reinterpret_cast<const float4*>(op + ((size_t)(k0 + k) * BM + r) * DV + c));
#pragma unroll
      for (int k = 0; k < MERGE_LOADS; ++k) {
        if (k0 + k >= clusters) break;
        const float w = sw[(k0 + k) * BM + r];
        acc.x += w * v[k].x, acc.y += w * v[k].y, acc.z += w * v[k].z, acc.w += w * v[k].w;
      }
    }
      store4(out, nullptr, r, c, acc);
  }
  if (lse && threadIdx.x < rows_real) lse[threadIdx.x] = slse[threadIdx.x];
  TRACE(7);
}

// The split-KV merge, run by every block of a live cluster once its partial is in shared memory. Not
// inlined: the key loop then keeps MT 1's 128-register budget to itself.
template <int MT>
__device__ __noinline__ void merge_splits(const Params& p, uint8_t* smem) {
  using C = Cfg<MT>;
  constexpr int BM = C::BM;
  float* sS = reinterpret_cast<float*>(smem + C::K);
  float* sLse = reinterpret_cast<float*>(smem + C::K + C::S + C::P + C::WORDS);
  float* sO = reinterpret_cast<float*>(smem);
  const int rt = blockIdx.x, split = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, row0 = rt * BM;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  TRACE(3);

  // Step 1: block q of the cluster merges columns [q W, q W + W) of the cluster's CL partials.
  // Recomputed rather than kept live across the key loop (MT 1 runs at its 128-register cap).
  const int clusters = [&] {
    const int L2 = static_cast<int>(p.prefix[b]);
    int chunk2, active2;
    split_geometry(p, max(1, min(L2 + p.N, p.max_len)), chunk2, active2);
    return (active2 + p.CL - 1) / p.CL;
  }();
  const int CL = p.CL, q = (int)cluster.block_rank(), W = DV / CL, cid = split / CL;
  const int rows_real = min(BM, p.R - row0);
  const size_t tile = (size_t)b * p.RT + rt;
  const int ncl = p.S_max / CL;
  __nv_bfloat16* out = clusters == 1 ? p.out + ((size_t)b * p.R + row0) * DV : nullptr;
  float* sW = sS;  // [CL][BM] weights, then [BM] merged lse: the score buffer is free
  float* sLc = sW + 8 * BM;
  merge_weights<BM>(CL, rows_real, [&](int k, int r) { return *cluster.map_shared_rank(sLse + r, k); }, sW, sLc);
  for (int item = tid; item < rows_real * (W / 4); item += THREADS) {
    const int r = item / (W / 4), c = q * W + (item % (W / 4)) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k0 = 0; k0 < 8; k0 += 4) {  // four remote reads in flight (eight spill under MT 1's cap)
      float4 v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (k0 + k < CL) v[k] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(sO + r * LDO + c, k0 + k));
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float w = k0 + k < CL ? sW[(k0 + k) * BM + r] : 0.f;
        if (w == 0.f) continue;  // an empty partial (idle split) may hold anything
        acc.x += w * v[k].x, acc.y += w * v[k].y, acc.z += w * v[k].z, acc.w += w * v[k].w;
      }
    }
    store4(out, p.o_part + ((tile * ncl + cid) * BM) * DV, r, c, acc);
  }
  if (q == 0 && tid < rows_real) {
    if (out) p.lse[(size_t)b * p.R + row0 + tid] = sLc[tid];
    else __stcg(p.lse_part + (tile * ncl + cid) * BM + tid, sLc[tid]);
  }
  cluster.sync();  // every distributed-shared-memory read is done before a block of the cluster moves on
  TRACE(4);
  if (out) return;

  // Step 2: the last cluster to arrive merges the clusters' partials, each block its column slice.
  __shared__ int s_last;
  __threadfence();  // this block's slice is visible device-wide before the count says so
  cluster.sync();
  if (q == 0 && tid == 0) {
    int* cnt = p.counters + tile;
    const int last = atomicAdd(cnt, 1) == clusters - 1;
    if (last) atomicExch(cnt, 0);  // every cluster has arrived: zero again for the next call / graph replay
    s_last = last;
  }
  cluster.sync();
  const int last = *cluster.map_shared_rank(&s_last, 0);
  cluster.sync();  // rank 0's flag is read before it may exit
  if (!last) return;
  TRACE(6);
  __threadfence();  // acquire: the other clusters' partials are read after their counts
  merge_clusters<BM>(p.lse_part + tile * ncl * BM, p.o_part + tile * ncl * BM * DV,
                     p.out + ((size_t)b * p.R + row0) * DV, q == 0 ? p.lse + (size_t)b * p.R + row0 : nullptr,
                     clusters, rows_real, q * W, W, reinterpret_cast<float*>(smem));
}

template <int MT>
__global__ void __launch_bounds__(THREADS, MT == 1 ? 2 : 1) tree_attn_kernel(Params p) {
  using C = Cfg<MT>;
  constexpr int BM = C::BM;
  constexpr int LPR = 16 / MT;  // softmax lanes per query row (MT keys each)
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem);
  float* sS = reinterpret_cast<float*>(smem + C::K);  // [KQ][BM][LDSS]
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + C::K + C::S);
  int64_t* sWords = reinterpret_cast<int64_t*>(smem + C::K + C::S + C::P);  // [BM][4]
  float* sAlpha = reinterpret_cast<float*>(smem + C::K + C::S + C::P + C::WORDS);
  float* sM = sAlpha + BM;
  float* sL = sM + BM;

  const int rt = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int row0 = rt * BM;
  // Q first (it depends on nothing): its load overlaps the reads of the sequence's length and row.
  {
    __nv_bfloat16* sQ = sK + (NSTAGE - MT) * BN * LDS;
    for (int i = tid; i < BM * CHUNK_PER_ROW; i += THREADS) {
      const int r = i / CHUNK_PER_ROW, c = (i % CHUNK_PER_ROW) * 8;
      const int row = min(row0 + r, p.R - 1);
      cp_async16(sQ + r * LDS + c, p.q + ((size_t)b * p.R + row) * DQK + c, row0 + r < p.R);
    }
  }
  const int L = static_cast<int>(p.prefix[b]);
  const int T = max(1, min(L + p.N, p.max_len));  // inside a graph reads are clamped to the cache row
  int chunk, active;
  split_geometry(p, T, chunk, active);
  if (split / p.CL >= (active + p.CL - 1) / p.CL) {  // no live split in this block's cluster  // the whole cluster is idle: every block of it leaves here
    cp_wait<0>();                  // nothing may land in shared memory after the block exits
    return;
  }
  TRACE(0);
  // A split past `active` in a live cluster streams nothing and contributes an empty partial.
  const int k0 = split < active ? split * chunk : 0, k1 = split < active ? min(T, k0 + chunk) : 0;
  const __nv_bfloat16* kv = p.cache + (size_t)p.rows[b] * p.max_len * DQK;
  const int n_tiles = (k1 - k0 + BN - 1) / BN;

  auto load_tile = [&](int it) {
    if (it < n_tiles) {
      const int key0 = k0 + it * BN;
      __nv_bfloat16* dst = sK + (it % NSTAGE) * BN * LDS;
      for (int i = tid; i < BN * CHUNK_PER_ROW; i += THREADS) {
        const int r = i / CHUNK_PER_ROW, c = (i % CHUNK_PER_ROW) * 8;
        const int key = min(key0 + r, k1 - 1);
        cp_async16(dst + r * LDS + c, kv + (size_t)key * DQK + c, key0 + r < k1);
      }
    }
    cp_commit();  // always commit, so the group count per iteration stays uniform
  };

  // Q (rows past R zero-filled, issued above) is staged in the last MT stages, the first tiles alongside.
  {
    for (int it = 0; it < NSTAGE - MT; ++it) {
      if (it < n_tiles) {
        const int key0 = k0 + it * BN;
        __nv_bfloat16* dst = sK + it * BN * LDS;
        for (int i = tid; i < BN * CHUNK_PER_ROW; i += THREADS) {
          const int r = i / CHUNK_PER_ROW, c = (i % CHUNK_PER_ROW) * 8;
          const int key = min(key0 + r, k1 - 1);
          cp_async16(dst + r * LDS + c, kv + (size_t)key * DQK + c, key0 + r < k1);
        }
      }
    }
    cp_commit();
  }
  const int nt = warp & 1, kq = warp >> 1;  // S-phase role: key n-tile, dim quarter
  uint32_t qa[MT][KSTEPS][4];
  cp_wait<0>();
  __syncthreads();
  {
    const __nv_bfloat16* sQ = sK + (NSTAGE - MT) * BN * LDS;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk)
        ldsm_x4(qa[m][kk], sQ + (m * 16 + (lane & 15)) * LDS + kq * 144 + kk * 16 + (lane >> 4) * 8);
  }
  __syncthreads();  // Q read: its stages may now take tiles
  TRACE(1);
  for (int it = NSTAGE - MT; it < NSTAGE - 1; ++it) load_tile(it);

  // Softmax role: row sr, keys sc .. sc + MT - 1 of each tile; the row's mask words.
  const int sr = tid / LPR, sc = (tid % LPR) * MT;
  // Each row's ancestor words in shared memory: no global pointer stays live through the key loop.
  for (int i = tid; i < BM * p.W; i += THREADS) {
    const int r = i / p.W;
    sWords[r * 4 + i % p.W] = p.words[((size_t)b * p.N + min(row0 + r, p.R - 1) / p.H) * p.W + i % p.W];
  }
  const int64_t* my_words = sWords + sr * 4;
  float m_run = -CUDART_INF_F, l_run = 0.f;

  float o[MT][8][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[m][n][i] = 0.f;

  // S partial over this warp's dim quarter for keys nt*8 .. +8 of the tile in `stage` -> sS.
  auto score_tile = [&](int stage) {
    const __nv_bfloat16* tK = sK + stage * BN * LDS;
    // Two accumulators per m-tile (MT 2) halve the dependent-MMA chain: latency, not throughput, bounds a tile.
    float s[MT][4], s2[MT][4];
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
    float* sSq = sS + kq * BM * LDSS;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      mma_bf16(s[m], qa[m][KSTEPS - 1], bl[0], bl[1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) s[m][i] += s2[m][i];
      *reinterpret_cast<float2*>(sSq + (m * 16 + g) * LDSS + nt * 8 + 2 * t) = make_float2(s[m][0], s[m][1]);
      *reinterpret_cast<float2*>(sSq + (m * 16 + g + 8) * LDSS + nt * 8 + 2 * t) = make_float2(s[m][2], s[m][3]);
    }
  };

  // Online softmax of the tile starting at key0: this thread's MT scores of row sr, reductions over its
  // LPR lanes by shuffles; P -> sP (bf16), the rescale factor -> sAlpha.
  auto softmax_tile = [&](int key0) {
    float sv[MT], mx = -CUDART_INF_F;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const int key = key0 + sc + j;
      bool vis = key < k1;
      if (vis && key >= L) {
        const int i = key - L;
        vis = (my_words[i >> 6] >> (i & 63)) & 1;
      }
      float acc = 0.f;
#pragma unroll
      for (int q4 = 0; q4 < KQ; ++q4) acc += sS[(q4 * BM + sr) * LDSS + sc + j];
      sv[j] = vis ? acc * p.scale_log2 : -CUDART_INF_F;
      mx = fmaxf(mx, sv[j]);
    }
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float m_new = fmaxf(m_run, mx);
    float alpha = 1.f, sum = 0.f;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const float pj = m_new == -CUDART_INF_F ? 0.f : exp2f(sv[j] - m_new);
      sP[sr * LDP + sc + j] = __float2bfloat16(pj);
      sum += pj;  // unrounded, as FlashAttention does: keeps the log-sum-exp fp32-accurate
    }
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (m_new != -CUDART_INF_F) alpha = exp2f(m_run - m_new);  // 0 when m_run is -inf
    l_run = l_run * alpha + sum;
    m_run = m_new;
    if (tid % LPR == 0) sAlpha[sr] = alpha;
  };

  // O = alpha * O + P V over this warp's 64 output columns, V = the tile in `stage`.
  auto pv_tile = [&](int stage) {
    const __nv_bfloat16* tK = sK + stage * BN * LDS;
    uint32_t pa[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float al0 = sAlpha[m * 16 + g], al1 = sAlpha[m * 16 + g + 8];
#pragma unroll
      for (int n = 0; n < 8; ++n) o[m][n][0] *= al0, o[m][n][1] *= al0, o[m][n][2] *= al1, o[m][n][3] *= al1;
      ldsm_x4(pa[m], sP + (m * 16 + (lane & 15)) * LDP + (lane >> 4) * 8);
    }
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
  };

  // Software-pipelined: P V of tile `it` and S of tile `it + 1` are independent, so they run between the
  // same two barriers and their MMAs overlap; the softmax of `it + 1` follows. Tile 0's S and softmax
  // run ahead of the loop (tile 0 landed with Q).
  score_tile(0);  // an idle split (k0 = k1 = 0) scores a stale stage, and the softmax masks every key
  __syncthreads();
  softmax_tile(k0);
  for (int it = 0; it < n_tiles; ++it) {
    cp_wait<NSTAGE - 3>();  // tile it + 1 landed
    __syncthreads();        // P(it) visible; everyone finished tile it - 1, so its stage is free
    load_tile(it + NSTAGE - 1);
    pv_tile(it % NSTAGE);
    score_tile((it + 1) % NSTAGE);  // past the last tile this scores a stale stage; the result is unused
    __syncthreads();
    if (it + 1 < n_tiles) softmax_tile(k0 + (it + 1) * BN);
  }
  TRACE(2);
  cp_wait<0>();  // no copy may land in shared memory after the block exits

  if (tid % LPR == 0) sM[sr] = m_run, sL[sr] = l_run;
  __syncthreads();  // also: every warp is past its last P V, so the key stages are free

  // This split's normalised partial -> own shared memory (fp32 [BM][LDO]) and its lse.
  float* sO = reinterpret_cast<float*>(smem);
  float* sLse = sAlpha;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = m * 16 + g + hh * 8;
      const float l = sL[r], inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n)
        *reinterpret_cast<float2*>(sO + r * LDO + warp * 64 + n * 8 + 2 * t) =
            make_float2(o[m][n][2 * hh] * inv, o[m][n][2 * hh + 1] * inv);
    }
  }
  if (tid < BM) sLse[tid] = sL[tid] > 0.f ? (sM[tid] + __log2f(sL[tid])) * 0.69314718055994531f : -CUDART_INF_F;
  merge_splits<MT>(p, smem);
}

int tile_rows(int N, int H) { return N * H >= 32 ? 32 : 16; }

// Workspace layout: counters (int32, zero at rest) | cluster lse partials | cluster o partials, 256-B aligned.
struct Layout {
  int BM, RT;
  size_t lse, o, total;
};

Layout layout(int B, int N, int H, int S_max, int CL) {
  Layout w;
  w.BM = tile_rows(N, H);
  w.RT = (N * H + w.BM - 1) / w.BM;
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t tiles = (size_t)B * w.RT, parts = tiles * (S_max / CL) * w.BM;
  w.lse = up(tiles * 4);
  w.o = w.lse + up(parts * 4);
  w.total = w.o + parts * DV * 4;
  return w;
}

template <int MT>
cudaError_t allow_smem() {
  static bool attr_set = false;  // per process; the attribute is per function, not per device
  if (attr_set) return cudaSuccess;
  cudaError_t e =
      cudaFuncSetAttribute(tree_attn_kernel<MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)Cfg<MT>::SMEM);
  attr_set = e == cudaSuccess;
  return e;
}

template <int MT>
cudaLaunchConfig_t config(dim3 grid, int CL, cudaStream_t st, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t c = {};
  c.gridDim = grid, c.blockDim = dim3(THREADS), c.dynamicSmemBytes = Cfg<MT>::SMEM, c.stream = st;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 1, attr->val.clusterDim.y = CL, attr->val.clusterDim.z = 1;
  c.attrs = attr, c.numAttrs = 1;
  return c;
}

// Splits and cluster size for (B, N, H): one full wave of clusters of up to 8 splits.
template <int MT>
int plan(int B, int N, int H, int* splits, int* cluster) {
  if (const cudaError_t e = allow_smem<MT>(); e != cudaSuccess) return (int)e;
  int dev = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tree_attn_kernel<MT>, THREADS, Cfg<MT>::SMEM);
  if (e != cudaSuccess) return (int)e;
  const int tiles = B * ((N * H + 16 * MT - 1) / (16 * MT));
  const int blocks = per_sm * sms / tiles;  // splits per row tile in one wave
  // Clusters live within a GPC, so large clusters may fit fewer blocks than the SM count suggests (a
  // partial second wave of clusters doubles the time): take the largest cluster that still fills >= 80 %
  // of the wave (the merge gets cheaper with the cluster size), else no clusters.
  const int want = max(1, min(1024, blocks));
  int best_S = want, best_CL = 1;
  for (int CL = 8; CL >= 2; CL /= 2) {
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t c = config<MT>(dim3(1, CL, 1), CL, nullptr, &attr);
    int max_clusters = 0;
    e = cudaOccupancyMaxActiveClusters(&max_clusters, tree_attn_kernel<MT>, &c);
    if (e != cudaSuccess) return (int)e;
    const int S = min(want / CL, max_clusters / tiles) * CL;
    if (S >= CL && 5 * S >= 4 * want) {
      best_S = S, best_CL = CL;
      break;
    }
  }
  *splits = best_S, *cluster = best_CL;
  return 0;
}

template <int MT>
int launch(const Params& p, int B, cudaStream_t st) {
  if (const cudaError_t e = allow_smem<MT>(); e != cudaSuccess) return (int)e;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t c = config<MT>(dim3(p.RT, p.S_max, B), p.CL, st, &attr);
  return (int)cudaLaunchKernelEx(&c, tree_attn_kernel<MT>, p);
}

}  // namespace

// Bytes of workspace for a (B, N, H, S_max, CL) call; its first `k26_mla_tree_attn_counter_bytes` bytes
// must be zeroed once when it is allocated (the kernel leaves them zero).
K26_EXPORT size_t k26_mla_tree_attn_workspace(int B, int N, int H, int S_max, int CL) {
  return layout(B, N, H, S_max, CL).total;
}
K26_EXPORT size_t k26_mla_tree_attn_counter_bytes(int B, int N, int H, int S_max, int CL) {
  return layout(B, N, H, S_max, CL).lse;
}
#ifdef K26_ATTN_TRACE
K26_EXPORT int k26_mla_tree_attn_trace(void* host) {
  return (int)cudaMemcpyFromSymbol(host, g_attn_trace, sizeof(g_attn_trace));
}
K26_EXPORT int k26_mla_tree_attn_trace_reset() {
  static unsigned long long zeros[1024][16];
  return (int)cudaMemcpyToSymbol(g_attn_trace, zeros, sizeof(zeros));
}
#endif
K26_EXPORT int k26_mla_tree_attn_tile_rows(int N, int H) { return tile_rows(N, H); }
// The launch plan for (B, N, H) on the current device: splits per row tile and the cluster size.
K26_EXPORT int k26_mla_tree_attn_plan(int B, int N, int H, int* splits, int* cluster) {
  return tile_rows(N, H) == 16 ? plan<1>(B, N, H, splits, cluster) : plan<2>(B, N, H, splits, cluster);
}

// Returns a cudaError_t. Shapes are validated by the Python front door (k26/ops/attention_cuda.py).
K26_EXPORT int k26_mla_tree_attn(const void* q, const void* cache, const int64_t* rows, const int64_t* prefix,
                                 const int64_t* words, void* out, float* lse, void* workspace, int B, int N, int H,
                                 int W, int max_len, int S_max, int CL, int min_keys, float scale, void* stream) {
  if (CL < 1 || CL > 8 || S_max % CL) return (int)cudaErrorInvalidValue;
  const Layout w = layout(B, N, H, S_max, CL);
  char* ws = static_cast<char*>(workspace);
  Params p;
  p.q = (const __nv_bfloat16*)q, p.cache = (const __nv_bfloat16*)cache, p.rows = rows, p.prefix = prefix,
  p.words = words, p.out = (__nv_bfloat16*)out, p.lse = lse;
  p.counters = reinterpret_cast<int*>(ws), p.lse_part = reinterpret_cast<float*>(ws + w.lse),
  p.o_part = reinterpret_cast<float*>(ws + w.o);
  p.N = N, p.H = H, p.W = W, p.R = N * H, p.RT = w.RT, p.max_len = max_len, p.S_max = S_max, p.CL = CL,
  p.min_keys = min_keys < BN ? BN : min_keys;
  p.scale_log2 = scale * 1.4426950408889634f;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return w.BM == 16 ? launch<1>(p, B, st) : launch<2>(p, B, st);
}
