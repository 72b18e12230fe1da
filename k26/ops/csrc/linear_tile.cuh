// The small-M linear kernel's tile mode (csrc/linear_smallm.cu, torch.ops.k26.linear): the launch parameters,
// the streamed weight loads, the swap-AB mma on a lane's 16-byte fragments, the rounding point, and tile mode's
// loop (two register batches of weights and x in flight) and its warp-order reduction + store. The layout, the k
// permutation and why tile mode is batch-invariant: csrc/linear_smallm.cu's header.
//
// Legality: mma.sync.m16n8k16 bf16, ld.global(.nc), shared memory for the warps' sums: sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "pdl.cuh"

namespace k26_linear {

constexpr int kUnit = 32;      // k per unit: one 16-byte load per lane per operand row

struct Params {
  const __nv_bfloat16* x;         // [M, *] rows x_ld apart, group g at + g * x_gs
  const __nv_bfloat16* w;         // [N, K] rows w_ld apart, group g at + g * w_gs
  const __nv_bfloat16* residual;  // like y, or null
  __nv_bfloat16* y;               // [M, *] rows y_ld apart, group g at + g * y_gs
  float* partial;                 // [G, S, M, N] fp32 when S > 1
  int* counters;                  // [G, gridDim.x] zeros when S > 1
  long long x_ld, x_gs, w_ld, w_gs, y_ld, y_gs;
  int M, N, K, S, units_per_split;
  int up = 0;  // linear_swiglu_kernel: the up rows' first row in w (gate rows [0, N), up rows [up, up + N))
};

// Loads and griddepcontrol.wait. ptxas treats a non-coherent (.nc) load as free to move across the wait (.nc
// promises data read-only for the kernel's lifetime, which PDL's overlap with the previous kernel breaks), and
// a coherent one as not (scripts/sass_schedule.py shows the SASS order):
// - x is the previous kernel's output, read after the wait: coherent (ld.global.ca, below). With __ldg (until
//   2026-12-05) the sm_120a build of the deep kernels (linear_tile_kernel<1 | 2, 4, 1>) had one x load hoisted
//   above the wait, a race on the target GPU (tests/test_sass_schedule.py checks every tile kernel now).
// - the weights are constants, loaded coherently so that the batches meant to be in flight across the wait
//   stay above it (as .nc loads, until 2026-12-05, ptxas sank them below it on sm_90a: no overlap with the
//   previous kernel at all). Measured 2026-12-05 on an H200 (the 61-layer TP8-rank step, 4K, two A/B rounds):
//   decode 4.19-4.20 -> 4.08 ms, verify N = 16 6.85-6.86 -> 6.68-6.69 ms; q_a + kv_a 10.3 -> 8.0 µs a layer
//   (profiling/results/2026-12-05-session24-h200.md).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;  // weights are read once: keep them out of L1
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// x (the previous kernel's output, read after the wait): through L1 (csrc/pdl.cuh ld_after_wait), so the blocks
// sharing an SM (o_proj: 448 blocks, the lm_head shard: 1280) read each x line from L2 once, not once a block; the
// weights bypass L1, so x has it to itself. tests/test_sass_schedule.py checks that x stays below the wait.
// Measured against __ldcg (L2 only) on an H100, 2026-12-07
// (profiling/results/2026-12-07-x-through-l1-session43-h100.md): o_proj at M = 16 9.55 -> 8.76 µs, the lm_head
// shard 112.2 -> 107.7, the verify N = 16 step 7.30 -> 7.27 ms; M = 1 and the one-block-per-SM projections unchanged.
__device__ __forceinline__ uint4 ld_x(const void* p) { return ld_after_wait(p); }

__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Unit u's 16 bytes of rows g and g + 8 for this lane; zeros past K (K % 8 == 0: a load is all in or all out).
template <int B>
__device__ __forceinline__ void load_batch(uint4 (&w)[B][2], const __nv_bfloat16* w_lo, const __nv_bfloat16* w_hi,
                                           int u, int u_end, int kt, int K) {
#pragma unroll
  for (int i = 0; i < B; ++i) {
    const int k = (u + i) * kUnit + kt;
    if (u + i < u_end && k < K) {
      w[i][0] = ld_stream(w_lo + k);
      w[i][1] = ld_stream(w_hi + k);
    } else {
      w[i][0] = w[i][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

__device__ __forceinline__ __nv_bfloat16 finish(float v, const __nv_bfloat16* residual, long long at) {
  // The reference's rounding points: bf16(x @ W^T), then bf16(that + residual).
  const __nv_bfloat16 r = __float2bfloat16(v);
  return residual ? __float2bfloat16(__bfloat162float(r) + __bfloat162float(residual[at])) : r;
}

// SwiGLU's rounding points, as the reference's eager bf16 ops: gate and up rounded as projections, F.silu's
// bf16 result (fp32 inside, expf as ATen's kernel), then the bf16 product.
__device__ __forceinline__ __nv_bfloat16 swiglu(float gate, float up) {
  const float g = __bfloat162float(__float2bfloat16(gate)), u = __bfloat162float(__float2bfloat16(up));
  const float s = __bfloat162float(__float2bfloat16(g / (1.f + expf(-g))));
  return __float2bfloat16(s * u);
}

// Tile mode (S == 0; the default for every M <= 64; see the header): x comes straight from global memory
// (L1 / L2: every tile reads it), no staging. No workspace, no counters, no second pass: a projection is one
// round of weight loads and one barrier, where split-K pays a partial store, a fence, an atomic and the last
// block's reads of S partials. Batch-invariant: a warp's k range does not depend on M and it accumulates unit
// by unit whatever its batch size, so a row of y has the same bits at every M (a verify step reproduces
// decode's logits bit for bit); split-K's plan (and so its sums) changes with M. The modes agree to rounding.
constexpr int kTileWarps = 8, kTileThreads = 32 * kTileWarps;

// Units per register batch B (two batches in flight) and blocks per SM: two units up to 16 tokens, one beyond
// (the x fragments grow with the token tiles); 2 blocks per SM within 128 registers up to 32 tokens, 1 at 64.
// A grid of at most one block per SM (q_a / kv_a: 132 blocks, q_b, W_UK, W_UV) has no second block to hide
// latency with, so up to 16 tokens it takes the deep variant: 4 units per batch, twice the weight bytes in
// flight per warp, within one block's 255 registers. B changes only how many loads are in flight, never a
// warp's k range or its accumulation order: every variant gives the same bits.
template <int MT>
__host__ __device__ constexpr int tile_batch() { return MT <= 2 ? 2 : 1; }
template <int MT>
__host__ __device__ constexpr int tile_blocks() { return MT <= 4 ? 2 : 1; }
constexpr int kDeepBatch = 4;

// Unit u's x fragments of the token tiles j for this lane (row 8j + g, k = 32u + 8t .. +8); zeros past M or K.
// xr: this lane's row g at k = kt; tiles_live: the token tiles holding row 8j + g < M. SMEM: x is in shared
// memory (csrc/mla_glue_linear.cu stages its normed rows there), else global (ld_x: coherent, after the wait).
template <int MT, int B, bool SMEM = false>
__device__ __forceinline__ void load_x(uint4 (&xb)[B][MT], const __nv_bfloat16* xr, long long x_tile, int tiles_live,
                                       int u, int u_end, int kt, int K) {
#pragma unroll
  for (int i = 0; i < B; ++i) {
    const bool in = u + i < u_end && (u + i) * kUnit + kt < K;
#pragma unroll
    for (int j = 0; j < MT; ++j)
      if constexpr (SMEM)
        xb[i][j] = in && j < tiles_live ? *reinterpret_cast<const uint4*>(xr + j * x_tile + (u + i) * kUnit)
                                        : make_uint4(0, 0, 0, 0);
      else
        xb[i][j] = in && j < tiles_live ? ld_x(xr + j * x_tile + (u + i) * kUnit) : make_uint4(0, 0, 0, 0);
  }
}

template <int MT, int B>
__device__ __forceinline__ void compute_tile_batch(float (&acc)[MT][4], const uint4 (&w)[B][2],
                                                   const uint4 (&xb)[B][MT], int u, int u_end) {
#pragma unroll
  for (int i = 0; i < B; ++i) {
    if (u + i >= u_end) break;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const uint4 b = xb[i][j];
      mma_bf16(acc[j], w[i][0].x, w[i][1].x, w[i][0].y, w[i][1].y, b.x, b.y);
      mma_bf16(acc[j], w[i][0].z, w[i][1].z, w[i][0].w, w[i][1].w, b.z, b.w);
    }
  }
}

// Tile mode's main loop for one warp over units [u_begin, u_end): weight batches wa / wb (the first two already
// in flight) and x batches xa / xb (the MT token tiles' fragments, load_x), each buffer refilled as soon as it is
// consumed. Called after the grid-dependency wait (x may come from the previous kernel).
template <int MT, int B, bool SMEM = false>
__device__ __forceinline__ void tile_loop(float (&acc)[MT][4], uint4 (&wa)[B][2], uint4 (&wb)[B][2],
                                          const __nv_bfloat16* w_lo, const __nv_bfloat16* w_hi,
                                          const __nv_bfloat16* xr, long long x_tile, int tiles_live, int u_begin,
                                          int u_end, int kt, int K) {
  uint4 xa[B][MT], xb[B][MT];
  load_x<MT, B, SMEM>(xa, xr, x_tile, tiles_live, u_begin, u_end, kt, K);
  load_x<MT, B, SMEM>(xb, xr, x_tile, tiles_live, u_begin + B, u_end, kt, K);
  for (int u = u_begin; u < u_end; u += 2 * B) {
    compute_tile_batch<MT, B>(acc, wa, xa, u, u_end);
    load_batch(wa, w_lo, w_hi, u + 2 * B, u_end, kt, K);
    load_x<MT, B, SMEM>(xa, xr, x_tile, tiles_live, u + 2 * B, u_end, kt, K);
    compute_tile_batch<MT, B>(acc, wb, xb, u + B, u_end);
    load_batch(wb, w_lo, w_hi, u + 3 * B, u_end, kt, K);
    load_x<MT, B, SMEM>(xb, xr, x_tile, tiles_live, u + 3 * B, u_end, kt, K);
  }
}

// The block's 8 warps' sums in warp order (deterministic), rounded as the reference (+ residual), stored by warp 0.
// SWIGLU (linear_swiglu_kernel): a lane's rows g and g + 8 are gate and up of output feature n_tile + g (the
// tile's 8 features), stored as swiglu(gate, up).
template <int MT, bool SWIGLU = false>
__device__ __forceinline__ void tile_store(const float (&acc)[MT][4], float (&red)[kTileWarps][MT * 4][32],
                                           const Params& p, int grp, int n_tile) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) red[warp][j * 4 + c][lane] = acc[j][c];
  __syncthreads();
  if (warp != 0) return;
  const __nv_bfloat16* res = p.residual ? p.residual + grp * p.y_gs : nullptr;
  __nv_bfloat16* yg = p.y + grp * p.y_gs;
  if constexpr (SWIGLU) {
#pragma unroll 1
    for (int j = 0; j < MT; ++j) {
      float v[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        v[c] = 0.f;
#pragma unroll
        for (int q = 0; q < kTileWarps; ++q) v[c] += red[q][j * 4 + c][lane];  // warp order: deterministic
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // (gate, up) = accumulators (j, c) and (j, c + 2)
        const int n = n_tile + g, m = 8 * j + 2 * t + c;
        if (n < p.N && m < p.M) yg[m * p.y_ld + n] = swiglu(v[c], v[c + 2]);
      }
    }
  } else {
#pragma unroll 1  // unrolled, the 8 x 4 x MT shared loads were hoisted at once (255 registers at MT 8)
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < kTileWarps; ++q) v += red[q][j * 4 + c][lane];  // warp order: deterministic
        const int n = n_tile + g + 8 * (c / 2), m = 8 * j + 2 * t + c % 2;  // accumulator (j, c)
        if (n < p.N && m < p.M) yg[m * p.y_ld + n] = finish(v, res, m * p.y_ld + n);
      }
  }
}

}  // namespace k26_linear
