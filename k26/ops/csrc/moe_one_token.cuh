// The one-token (decode, M = 1) paths of the fused MoE (csrc/moe_w4a16.cu, included there after its helpers
// dequant / mma_bf16 / bf16_round, inside its anonymous namespace; not a standalone header).
//
// gated_one_token: the gate/up rows of one routed expert for a group of one token, x staged in shared memory.
// down_combine_one_token: the down projection of every routed pair (and the shared expert) of one token and
//   their weighted sum in one launch: no y round trip through global memory and no combine launch.
// Both reproduce the general kernels' fragments, mma order and rounding points: bit-identical results.
//
// Legality: as moe_w4a16.cu (mma.sync, ld.global, prefetch, griddepcontrol; <= 37 KB static shared memory).

#pragma once

// Gate/up rows of one routed expert for a group of ONE token (decode), x's row staged in shared memory:
// B fragments come from there (lanes g = 0 hold the token, others zero), so a chunk in flight costs a
// lane 5 registers instead of 13 and kOneTokU chunks stay in flight (the register path keeps 4: its
// 14-chunk k range per warp at K2.6 took 4 round trips, this takes 2). Same fragments, same mma order as
// the register path: bit-identical. All threads of the block call it (it stages x and synchronises).
constexpr int kOneTokU = 8;
constexpr int kOneTokMaxK = 7168;  // the staged row's capacity (bf16): K2.6's hidden size

__device__ __forceinline__ void gated_one_token(const uint4* __restrict__ w, const uint32_t* __restrict__ s,
                                                const __nv_bfloat16* __restrict__ xrow, int K, size_t tile_base,
                                                int c_begin, int c_end, uint4* xs, float acc[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint4 wv[kOneTokU];
  uint32_t sv[kOneTokU];
  auto load = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kOneTokU; ++u) {
      const size_t chunk = tile_base + c0 + u;
      if (c0 + u < c_end) {
        wv[u] = __ldcs(w + chunk * 32 + lane);  // streamed once: evict-first
        sv[u] = __ldg(s + chunk * 16 + 2 * g + (t >> 1));
      }
    }
  };
  load(c_begin);  // the first weight batch is in flight while x is staged
  const uint4* x4 = reinterpret_cast<const uint4*>(xrow);
  for (int i = threadIdx.x; i < K / 8; i += blockDim.x) xs[i] = __ldg(x4 + i);
  __syncthreads();
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c0 = c_begin; c0 < c_end; c0 += kOneTokU) {
    if (c0 != c_begin) load(c0);
#pragma unroll
    for (int u = 0; u < kOneTokU; ++u) {
      if (c0 + u >= c_end) break;
      const uint4 b[2] = {g == 0 ? xs[(c0 + u) * 8 + 2 * t] : zero, g == 0 ? xs[(c0 + u) * 8 + 2 * t + 1] : zero};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t word = j == 0 ? wv[u].x : j == 1 ? wv[u].y : j == 2 ? wv[u].z : wv[u].w;
        uint32_t a[4];
        dequant(word, sv[u], a);
        const uint4 bb = b[j >> 1];
        mma_bf16(acc, a, (j & 1) ? bb.z : bb.x, (j & 1) ? bb.w : bb.y);
      }
    }
  }
}


// down_combine_one_token: one warp per 16-row tile of the output (D / 16 tiles), over all of K = I, for every
// routed pair of the token (direct routing: pair k's expert is ids[k]) and the shared expert (slot topk of
// act), then out = bf16( bf16(sum_k w_k * bf16(y_k)) + bf16(y_shared) ) in k order, as combine_kernel.
// One chunk of every pair in flight per warp (~56 registers: the pairs' weights are prefetched into L2
// before the grid-dependency wait, so the K loop runs on L2 hits); the act rows are staged in shared memory
// (lanes g = 0 hold the token's B fragments, others zero).
constexpr int kDownOneTokPairs = 8;   // topk <= 8
constexpr int kDownOneTokWarps = 2;   // warps (tiles) per block: 224 blocks at D = 7168
constexpr int kDownOneTokMaxI = 512;  // K chunks per warp <= 8 (TP1's I = 2048 keeps the general path)

__global__ void __launch_bounds__(32 * kDownOneTokWarps) down_combine_one_token(
    const __nv_bfloat16* __restrict__ act, const uint4* __restrict__ w2, const uint32_t* __restrict__ s2, int I,
    int n_tiles, const int64_t* __restrict__ ids, const float* __restrict__ topw, int topk, int E,
    const __nv_bfloat16* __restrict__ sd, __nv_bfloat16* __restrict__ out) {
  __shared__ uint4 sact[(kDownOneTokPairs + 1) * kDownOneTokMaxI / 8];
  pdl_trigger();  // the next kernel waits for us before reading out
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x * kDownOneTokWarps + warp;
  const bool active = tile < n_tiles;
  const int KC = I >> 6;
  // ids come from the router, complete before the gate/up GEMM's routed blocks let this grid launch.
  int e[kDownOneTokPairs];
#pragma unroll
  for (int k = 0; k < kDownOneTokPairs; ++k) {
    e[k] = -1;
    if (k < topk) {
      const int64_t id = __ldcg(ids + k);
      if (id >= 0 && id < E) e[k] = (int)id;
    }
  }
  const size_t row_a = (size_t)tile * 16 + g;
  const uint4* ra = reinterpret_cast<const uint4*>(sd + row_a * I) + 2 * t;
  const uint4* rb = reinterpret_cast<const uint4*>(sd + (row_a + 8) * I) + 2 * t;
  if (active) {
    for (int c = 0; c < KC; ++c) {
#pragma unroll
      for (int k = 0; k < kDownOneTokPairs; ++k)
        if (e[k] >= 0) {
          const size_t chunk = ((size_t)e[k] * n_tiles + tile) * KC + c;
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(w2 + chunk * 32 + lane));
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(s2 + chunk * 16));
        }
      if (sd) {
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ra + c * 8));
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(rb + c * 8));
      }
    }
  }
  pdl_wait();  // act comes from the gate/up GEMM
  const int rows = topk + (sd ? 1 : 0);
  const uint4* a4 = reinterpret_cast<const uint4*>(act);
  for (int i = threadIdx.x; i < rows * I / 8; i += blockDim.x) sact[i] = __ldcg(a4 + i);
  __syncthreads();
  if (!active) return;
  float acc[kDownOneTokPairs][4], accs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < kDownOneTokPairs; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[k][i] = 0.f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c = 0; c < KC; ++c) {
    uint4 wv[kDownOneTokPairs], wa[2], wb[2];
    uint32_t sv[kDownOneTokPairs];
#pragma unroll
    for (int k = 0; k < kDownOneTokPairs; ++k)
      if (e[k] >= 0) {
        const size_t chunk = ((size_t)e[k] * n_tiles + tile) * KC + c;
        wv[k] = __ldcs(w2 + chunk * 32 + lane);
        sv[k] = __ldg(s2 + chunk * 16 + 2 * g + (t >> 1));
      }
    if (sd) {
#pragma unroll
      for (int q = 0; q < 2; ++q) wa[q] = __ldcs(ra + c * 8 + q), wb[q] = __ldcs(rb + c * 8 + q);
    }
#pragma unroll
    for (int k = 0; k < kDownOneTokPairs; ++k) {
      if (e[k] < 0) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t word = j == 0 ? wv[k].x : j == 1 ? wv[k].y : j == 2 ? wv[k].z : wv[k].w;
        uint32_t a[4];
        dequant(word, sv[k], a);
        const uint4 b = g == 0 ? sact[(size_t)k * (I / 8) + c * 8 + 2 * t + (j >> 1)] : zero;
        mma_bf16(acc[k], a, (j & 1) ? b.z : b.x, (j & 1) ? b.w : b.y);
      }
    }
    if (sd) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = j >> 1;
        const uint4 &A = wa[q], &B = wb[q];
        const uint32_t a[4] = {(j & 1) ? A.z : A.x, (j & 1) ? B.z : B.x, (j & 1) ? A.w : A.y, (j & 1) ? B.w : B.y};
        const uint4 b = g == 0 ? sact[(size_t)topk * (I / 8) + c * 8 + 2 * t + q] : zero;
        mma_bf16(accs, a, (j & 1) ? b.z : b.x, (j & 1) ? b.w : b.y);
      }
    }
  }
  if (t != 0) return;  // lanes t = 0 hold the token's column: rows g (element 0) and g + 8 (element 2)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kDownOneTokPairs; ++k)
      if (e[k] >= 0) sum += __ldg(topw + k) * bf16_round(acc[k][2 * h]);
    if (sd) sum = bf16_round(sum) + bf16_round(accs[2 * h]);
    out[(size_t)tile * 16 + g + 8 * h] = __float2bfloat16(sum);
  }
}
