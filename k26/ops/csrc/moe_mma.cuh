// The int4 MoE kernels' building blocks (csrc/moe_w4a16.cu, csrc/moe_one_token.cuh): int4 -> bf16 A fragments
// (dequant), the bf16 mma, the reference's bf16 rounding point, and the shared expert's bf16 rows (shared_acc).
// Layouts and the k permutation are described at the top of moe_w4a16.cu.
//
// Legality: lop3, bf16x2 arithmetic, mma.sync.m16n8k16 and plain loads: sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "pdl.cuh"

namespace k26_moe {

// The two-tile gate/up GEMM (csrc/moe_gemm.cuh: more than 64 pairs, nt = 1) runs three blocks per SM on sm_90:
// 80 registers with 3 routed chunks in flight per warp (4 otherwise) and the shared expert's bf16 chunks one at
// a time (shared_acc; 2 otherwise), no spills, so the verify N = 16 step's ~430 gate/up blocks take one wave
// instead of ~1.6 (6.86 / 6.91 -> 6.80 / 6.79 ms, 2026-12-04-moe-gate-up-3per-sm-session17-h200.md). sm_120
// keeps one block per SM (K26_MINB) and so the wider batches.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr bool kGateUpThreePerSM = false;
#else
constexpr bool kGateUpThreePerSM = true;
#endif

// A weight load: streamed once, ld.global.cs (evict-first in L1 and L2, so L2 keeps the activations). (The small-M
// linear's ld.global.nc.L1::no_allocate measured no faster here: 2026-12-05-session22-h200.md.)
__device__ __forceinline__ uint4 ld_weight(const uint4* p) { return __ldcs(p); }

// An activation load after the grid-dependency wait (x, act): through L1 (csrc/pdl.cuh ld_after_wait), so the
// blocks sharing an SM read a token row's lines from L2 once, not once a block (with skewed routing most groups hold
// most tokens). The shared expert's blocks read x before their wait: shared_acc keeps __ldcg. Measured against
// __ldcg on an H100, 2026-12-07 (profiling/results/2026-12-07-x-through-l1-session43-h100.md): the verify N = 16
// step with skewed routing 6.25 -> 6.13 ms, the whole DDTree budget-15 step 7.18 / 7.22 -> 7.03 / 7.05, bench_moe's
// skewed M = 16 block 42.8 -> 40.3 µs; uniform routing and one token unchanged. Weights bypassing L1 beside it
// (ld.global.L1::no_allocate) measured slower: verify 7.42 ms, the skewed block 44.5 µs.
__device__ __forceinline__ uint4 ld_act(const uint4* p) { return ld_after_wait(p); }

__device__ __forceinline__ uint32_t lop_and_or(uint32_t a, uint32_t mask, uint32_t ex) {
  uint32_t r;  // (a & mask) | ex in one instruction
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(ex));
  return r;
}

__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 as_bf2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// One packed word -> the 4 A-fragment registers of one k-step, scaled by rows g (lo) and g+8 (hi).
__device__ __forceinline__ void dequant(uint32_t w, uint32_t s_pair, uint32_t a[4]) {
  const __nv_bfloat162 s2 = as_bf2(s_pair);
  const __nv_bfloat162 s_lo = __bfloat162bfloat162(__low2bfloat16(s2));
  const __nv_bfloat162 s_hi = __bfloat162bfloat162(__high2bfloat16(s2));
  const __nv_bfloat162 bias = as_bf2(0x43084308u);  // 136.0: (128 + u) - 136 = u - 8 = q
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 v = __hsub2(as_bf2(lop_and_or(w >> (4 * i), 0x000f000fu, 0x43004300u)), bias);
    a[i] = as_u32(__hmul2(v, (i & 1) ? s_hi : s_lo));
  }
}

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One 64-wide k chunk: RT int4 weight tiles (wv[r], scales sv[r]) times NT 8-token B tiles (bv[nt]: a lane's 32
// activation bytes of the chunk), the chunk's 4 k-steps in order, tiles then n-tiles within a step: the mma order
// every routed GEMM path shares (so they stay bit-identical to each other).
template <int RT, int NT>
__device__ __forceinline__ void mma_chunk(const uint4 (&wv)[RT], const uint32_t (&sv)[RT], const uint4 (&bv)[NT][2],
                                          float (&acc)[RT][NT][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const uint32_t word = j == 0 ? wv[r].x : j == 1 ? wv[r].y : j == 2 ? wv[r].z : wv[r].w;
      uint32_t a[4];
      dequant(word, sv[r], a);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 b = bv[nt][j >> 1];
        mma_bf16(acc[r][nt], a, (j & 1) ? b.z : b.x, (j & 1) ? b.w : b.y);
      }
    }
  }
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16(v)); }

// The shared expert (group expert id == E) as bf16 rows: GATED: rows g / g+8 of a tile are gate / up row
// (tile*8 + g) of sa / sb [I, K]; else rows tile*16 + g and + 8 of sa [D, K]. Same k permutation as x.
template <int RT, int NT, bool GATED>
__device__ __forceinline__ void shared_acc(const __nv_bfloat16* __restrict__ sa, const __nv_bfloat16* __restrict__ sb,
                                           int K, int tile0, int c_begin, int c_end, const uint4* const* brow,
                                           float acc[RT][NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint4 *ra[RT], *rb[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const size_t row_a = GATED ? (size_t)(tile0 + r) * 8 + g : (size_t)(tile0 + r) * 16 + g;
    ra[r] = reinterpret_cast<const uint4*>(sa + row_a * K) + 2 * t;
    rb[r] = reinterpret_cast<const uint4*>((GATED ? sb + row_a * K : sa + (row_a + 8) * K)) + 2 * t;
  }
  // Two chunks in flight per warp: a bf16 chunk is 4x an int4 one, and one at a time left the shared
  // expert's blocks (4x the bytes of a routed tile) a round trip per chunk behind the routed ones.
  // (One at a time in the two-tile gate/up GEMM on sm_90, kGateUpThreePerSM: its registers.)
  constexpr int U = GATED && RT == 2 && NT == 1 && kGateUpThreePerSM ? 1 : 2;
  for (int c0 = c_begin; c0 < c_end; c0 += U) {
    uint4 wa[U][RT][2], wb[U][RT][2], bv[U][NT][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = min(c0 + u, c_end - 1);  // a repeated last chunk is loaded but not used
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int q = 0; q < 2; ++q)
          wa[u][r][q] = ld_weight(ra[r] + c * 8 + q), wb[u][r][q] = ld_weight(rb[r] + c * 8 + q);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int q = 0; q < 2; ++q)  // x / act, an earlier kernel's output: coherent (pdl.cuh)
          bv[u][nt][q] = brow[nt] ? __ldcg(brow[nt] + c * 8 + q) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c0 + u >= c_end) break;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = j >> 1;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const uint4 &A = wa[u][r][q], &B = wb[u][r][q];
          const uint32_t a[4] = {(j & 1) ? A.z : A.x, (j & 1) ? B.z : B.x, (j & 1) ? A.w : A.y,
                                 (j & 1) ? B.w : B.y};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint4 b = bv[u][nt][q];
            mma_bf16(acc[r][nt], a, (j & 1) ? b.z : b.x, (j & 1) ? b.w : b.y);
          }
        }
      }
    }
  }
}

}  // namespace k26_moe
