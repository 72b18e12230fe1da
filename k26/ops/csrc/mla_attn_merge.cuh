// The split-KV merge of the MLA tree-attention kernel (csrc/mla_tree_attn.cu), in the same launch: within a
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

}  // namespace k26_attn
