// The split-KV merge of the MLA tree-attention kernel (csrc/mla_tree_attn_kernel.cuh), in the same launch: within a
// thread-block cluster through distributed shared memory, then across clusters in the workspace.
//
// Legality: thread-block clusters of <= 8 with distributed shared memory (sm_90 and sm_120), plain loads and
// atomics: sm_90a and sm_120a.

#pragma once

#include "mla_attn_common.cuh"

namespace k26_attn {

// Split-KV merge, in two steps and without a second launch:
// 1. Within a thread-block cluster of CL splits (CL <= 8, along grid y): each block leaves its normalised
//    partial (o, lse) in its own shared memory; after a cluster barrier block q reduces output columns
//    [q * 512 / CL, +512 / CL) over the CL partials through distributed shared memory. The reduction is
//    spread over CL SMs and never touches global memory.
// 2. Across clusters, per column slice: block q writes slice q of its cluster's partial and its own copy
//    of the cluster's lse (every block of a cluster computes the same one) to the workspace and counts on
//    the atomic counter of (row tile, slice q). The block that brings it to the live cluster count resets it
//    (graph replays need no memset) and merges slice q over every cluster. Slice q's merger depends only on
//    the blocks q that counted on its counter, so no cluster barrier orders the hand-off: the blocks of a
//    cluster only keep each other's shared memory alive until their step-1 reads are done (a split cluster
//    barrier: arrive after the reads, wait just before exiting).
// Both steps run in a fixed order, so results are deterministic.
// Measured and dropped (2026-12-01-bench_moe-session11-h200.md, tree attention section): four items' loads in
// flight per thread at 32-row tiles (N = 16 at 4K 25.4 -> 26.5 µs), and the first partials' loads issued
// before the merge weights in both steps (no change at any shape): the merges are not bound by load latency.
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

// Step 2 of the merge, in the last block to count for its column slice: columns [c0, c0 + W) of the final
// output from the clusters' partials (lp: the slice's lse copies, one per cluster). Not inlined: the
// kernel's register budget (MT 1: 128) then need not hold it.
template <int BM>
__device__ __noinline__ void merge_clusters(const float* lp, const float* op, __nv_bfloat16* out, float* lse,
                                            int clusters, int rows_real, int c0, int W, float* sw) {
  float* slse = sw + clusters * BM;  // sw: [clusters][BM] weights, then [BM] merged lse
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
  // The cluster barrier split in two: arrive (release) now that this thread's reads of its peers' shared
  // memory are done, wait (acquire) just before the block exits or overwrites what peers read, so the
  // step-2 hand-off runs in between and the barrier's latency stays off the critical path. Every thread
  // arrives and waits exactly once.
  cluster.barrier_arrive();
  TRACE(4);
  if (out) {
    if (q == 0 && tid < rows_real) p.lse[(size_t)b * p.R + row0 + tid] = sLc[tid];
    cluster.barrier_wait();  // peers may still read this block's partial: it must outlive their reads
    return;
  }
  if (tid < rows_real) __stcg(p.lse_part + ((tile * CL + q) * ncl + cid) * BM + tid, sLc[tid]);

  // Step 2: the last block to count for slice q merges the slice over every cluster.
  __shared__ int s_last;
  __threadfence();  // this block's slice and lse copy are visible device-wide before the count says so
  __syncthreads();
  if (tid == 0) {
    int* cnt = p.counters + tile * CL + q;
    const int last = atomicAdd(cnt, 1) == clusters - 1;
    if (last) atomicExch(cnt, 0);  // every cluster has counted: zero again for the next call / graph replay
    s_last = last;
  }
  __syncthreads();
  if (!s_last) {
    cluster.barrier_wait();
    return;
  }
  TRACE(6);
  __threadfence();  // acquire: the other clusters' slices are read after their counts
  // The merge's weights go past this block's partial (sO) and below its lse, which peers may still be
  // reading (the region step 1's weights used is free again). Only when they do not fit there (more than
  // 751 clusters at MT 1, 167 at MT 2: beyond one wave of an H200) does the block first wait for its peers.
  constexpr int PART = BM * LDO, FREE = (int)((C::K + C::S + C::P + C::WORDS) / 4) - PART;
  const bool late = (clusters + 1) * BM <= FREE;
  if (!late) cluster.barrier_wait();
  merge_clusters<BM>(p.lse_part + (tile * CL + q) * ncl * BM, p.o_part + tile * ncl * BM * DV,
                     p.out + ((size_t)b * p.R + row0) * DV, q == 0 ? p.lse + (size_t)b * p.R + row0 : nullptr,
                     clusters, rows_real, q * W, W, late ? sO + PART : sO);
  if (late) cluster.barrier_wait();
}

}  // namespace k26_attn
