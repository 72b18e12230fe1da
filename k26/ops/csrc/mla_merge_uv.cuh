// The MLA value up-projection (W_UV) with the tree attention's split-KV merge in its prologue (decode; built with
// -DK26_ATTN_DEFER_VERIFY verify trees of up to 128 query rows too):
//
//   y[b, r, v] = sum_d W_UV[h][v, d] * o[b, r, d]        (r = n H + h; o = the attention's bf16 output)
//
// where o comes either from the attention kernel (its in-kernel merge, or a sequence of one split) or, for a
// sequence whose live split count is in (1, defer_max], from the splits' partials in the attention's workspace,
// merged here: the attention's blocks of such a call store their partials and leave (no barrier, no merge).
// Both kernels derive a sequence's split count from its length alone (split_geometry), so they agree without a
// flag and one CUDA graph serves every length (long contexts keep the merge spread over all the splits).
//
// Why: at 4K decode the attention's barrier and merge are ~4-5 µs of its ~12 µs in the step, latency of two
// grid-wide round trips (2026-12-07-session39-h100.md: the probe without them took the decode step 4.36 -> 4.07
// ms); at the 16-token verify tree (four 32-row tiles, 33 splits) they were ~8.5 µs of ~20 (session 18's trace,
// 2026-12-04-attn-trace-splits-session18-h200.md). Here the kernel boundary to W_UV is the barrier (~0.8 µs,
// boundary_probe.py), and the merge is one round of loads per block: a block owns one query row (its head's
// 512-dim latent) and 32 or 128 of its V outputs (merge_uv_kernel<RPW>), merges the row's partials into shared
// memory (4 slices of the splits x 128 float4 columns, UV_LOADS loads in flight a thread, the online
// log-sum-exp of csrc/mla_attn_merge.cuh), rounds the merged row to bf16 as the attention's output would be,
// and multiplies it by its W_UV rows.
//
// Bits: the merge combines the splits in a fixed order (a slice's splits in order, then the slices in order),
// the dot products in a fixed lane order: the same bits on every run. They differ from the in-kernel merge +
// linear_grouped composition by rounding only (tests/test_attention_uv_gpu.py: against the fp32 reference).
//
// Measured (H100, 2026-12-07-attention-uv-session41.md): the attention + W_UV pair at 4K decode 13.5 -> 10.1 µs
// alone, the 61-layer decode step 4.33 -> 4.23 ms. Tried and dropped (one step run each against 4.26 ms, in
// 3807997): a row's 4 blocks as a thread-block cluster, each merging a quarter of the dims and reading the rest
// through distributed shared memory (a quarter of the bytes a block) — 4.34 ms, the cluster barriers cost more
// than the bytes; o_proj released after the merge's loads instead of at the wait — 4.29 ms.
//
// Legality: plain and .cg loads, shuffles, 13 KB of static shared memory, griddepcontrol: sm_90a and sm_120a.

#pragma once

#include "mla_attn_common.cuh"
#include "mla_attn_merge.cuh"  // Lse4
#include "pdl.cuh"
#include "warp_mma.cuh"  // prefetch_l2

namespace k26_attn {

constexpr int UV_THREADS = 512;           // 16 warps
constexpr int UV_WARPS = UV_THREADS / 32;
constexpr int UV_COLS = DV / 4;           // float4 columns of a latent row
constexpr int UV_SLICES = UV_THREADS / UV_COLS;  // 4: thread t merges splits t / 128 + 4 i of column t % 128
constexpr int UV_LOADS = 17;              // (partial, lse) loads in flight a thread: 68 splits in one round

struct MergeUV {
  const float* lse_part;     // [B, RT, S_max, BM]       the attention's workspace
  const PartT* o_part;       // [B, RT, S_max, BM, 512]
  const __nv_bfloat16* out;  // [B, R, 512]          the attention's output where it merged (or had one split)
  const int64_t* prefix;     // [B]
  const __nv_bfloat16* w;    // W_UV: head h's row v at w + h * w_h + v * w_v, 512 contiguous values
  long long w_h, w_v;
  __nv_bfloat16* y;          // [B, R, V]
  int N, H, R, V, max_len, S_max, min_keys, defer_max;
  int BM, RT;                // the attention's row tiles: row r's partials in tile (b RT + r / BM), row r % BM
};

// A merged row's 4 values in bf16, the attention's output rounding.
__device__ __forceinline__ void store_merged(const Lse4& st, __nv_bfloat16* o4) {
  const float inv = st.s > 0.f ? 1.f / st.s : 0.f;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(o4);
  o[0] = __floats2bfloat162_rn(st.acc.x * inv, st.acc.y * inv);
  o[1] = __floats2bfloat162_rn(st.acc.z * inv, st.acc.w * inv);
}

// The sequence's split geometry as the attention kernel computes it (Params carries the same fields).
__device__ __forceinline__ int uv_active_splits(const MergeUV& m, int L) {
  Params p{};
  p.N = m.N, p.max_len = m.max_len, p.S_max = m.S_max, p.min_keys = m.min_keys;
  int chunk, active;
  split_geometry(p, live_keys(p, L), chunk, active);
  return active;
}

// Row r's partials merged into s_o (bf16, as the attention would have written it): thread t takes float4 column
// t % 128 of splits t / 128 + 4 i, UV_LOADS loads in flight; the 4 slices' states then combine in order.
__device__ __forceinline__ void merge_row(const MergeUV& m, int b, int r, int active, __nv_bfloat16* s_o) {
  __shared__ float s_m[UV_SLICES][UV_COLS], s_s[UV_SLICES][UV_COLS];
  __shared__ float4 s_acc[UV_SLICES][UV_COLS];
  const int tid = threadIdx.x, c = tid % UV_COLS, sl = tid / UV_COLS;
  const size_t first = ((size_t)b * m.RT + r / m.BM) * m.S_max * m.BM + r % m.BM;  // split 0's row
  const float* lp = m.lse_part + first;
  const PartT* op = m.o_part + first * DV + 4 * c;
  Lse4 st{-CUDART_INF_F, 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
  for (int k0 = sl; k0 < active; k0 += UV_SLICES * UV_LOADS) {
    float l[UV_LOADS];
    float4 v[UV_LOADS];
#pragma unroll
    for (int j = 0; j < UV_LOADS; ++j) {
      const int k = k0 + j * UV_SLICES;
      l[j] = k < active ? __ldcg(lp + k * m.BM) : -CUDART_INF_F;
      if (k < active) v[j] = load_part4(op + (size_t)k * m.BM * DV);
    }
#pragma unroll
    for (int j = 0; j < UV_LOADS; ++j)
      if (l[j] != -CUDART_INF_F) st.add(l[j], 1.f, v[j]);  // an empty partial adds nothing
  }
  s_m[sl][c] = st.m, s_s[sl][c] = st.s, s_acc[sl][c] = st.acc;
  __syncthreads();
  if (sl == 0) {
#pragma unroll
    for (int k = 1; k < UV_SLICES; ++k) st.add(s_m[k][c], s_s[k][c], s_acc[k][c]);
    store_merged(st, s_o + 4 * c);
  }
}

// A warp's RPW W_UV rows, lane l holding dims [8 l, +8) and [256 + 8 l, +8).
template <int RPW>
__device__ __forceinline__ void load_w_rows(const MergeUV& m, int h, int v0, int lane, uint4 (&wv)[RPW][2]) {
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const __nv_bfloat16* row = m.w + h * m.w_h + (long long)(v0 + i) * m.w_v;
#pragma unroll
    for (int k = 0; k < 2; ++k) wv[i][k] = __ldcg(reinterpret_cast<const uint4*>(row + k * 256 + lane * 8));
  }
}

// grid (R, V / (16 RPW), B): block (r, j, b) writes y[b, r, 16 RPW j .. +16 RPW), RPW rows a warp.
// RPW = 2 (few query rows: 4 blocks a K2.6 row): the warp's W_UV rows are loaded (coherently: csrc/pdl.cuh)
// before the grid-dependency wait, so their DRAM round trip overlaps the attention's tail. RPW = 8 (a verify
// tree's 128 rows: one block a row, one wave, each row's partials read once): 64 registers of W_UV would not
// fit beside the merge's loads at 512 threads (127 registers at RPW = 2), so the rows are only prefetched into
// L2 before the wait and loaded after the merge.
template <int RPW>
static __global__ void __launch_bounds__(UV_THREADS) merge_uv_kernel(MergeUV m) {
  __shared__ __align__(16) __nv_bfloat16 s_o[DV];
  const int r = blockIdx.x, b = blockIdx.z, h = r % m.H, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int v0 = (blockIdx.y * UV_WARPS + warp) * RPW;
  constexpr bool kEarly = RPW <= 2;
  uint4 wv[RPW][2];
  if constexpr (kEarly) {
    load_w_rows<RPW>(m, h, v0, lane, wv);
  } else {  // the warp's RPW rows of 1 KB: 8 lines a row, a lane's line at 128 B (lane % 8) of row lane / 8
#pragma unroll
    for (int i = lane / 8; i < RPW; i += 4) prefetch_l2(m.w + h * m.w_h + (long long)(v0 + i) * m.w_v + lane % 8 * 64);
  }
  const int L = static_cast<int>(m.prefix[b]);  // final before this step (the attention read it early too)
  pdl_wait();
  pdl_trigger();  // o_proj's blocks stream their weights beside the merge (a later trigger measured slower)
  const int active = uv_active_splits(m, L);
  if (active > 1 && active <= m.defer_max) {
    merge_row(m, b, r, active, s_o);
  } else if (tid < DV / 8) {  // the attention's own output: merged there, or a single split
    const uint4* row = reinterpret_cast<const uint4*>(m.out + ((size_t)b * m.R + r) * DV);
    reinterpret_cast<uint4*>(s_o)[tid] = __ldcg(row + tid);
  }
  if constexpr (!kEarly) load_w_rows<RPW>(m, h, v0, lane, wv);
  __syncthreads();
  float acc[RPW] = {};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint4 ov = reinterpret_cast<const uint4*>(s_o + k * 256)[lane];
    const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&ov);
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[i][k]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 a = __bfloat1622float2(o2[e]), w = __bfloat1622float2(w2[e]);
        acc[i] = fmaf(a.x, w.x, fmaf(a.y, w.y, acc[i]));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
  }
  if (lane < RPW) {
    float a = acc[0];
#pragma unroll
    for (int i = 1; i < RPW; ++i) a = lane == i ? acc[i] : a;
    m.y[((size_t)b * m.R + r) * m.V + v0 + lane] = __float2bfloat16_rn(a);
  }
}

}  // namespace k26_attn
