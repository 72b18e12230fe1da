// The fused INT4 MoE kernel's gate/up GEMM for many pairs (P > 64: verify trees of 9+ tokens at top-8),
// weights streamed through a cp.async ring in shared memory (csrc/moe_w4a16.cu launches it and describes
// the layouts; csrc/moe_gemm.cuh is the register-held GEMM it replaces there).
//
// Why: the register-held GEMM keeps a warp's chunks in flight in registers (2 KB per warp at two 16-row
// tiles), which at 128 registers leaves 2 blocks per SM — 32 KB of weights in flight per SM, about what an
// H200 needs at idle latency and well short of it under load — and its grid is one block per (tile pair,
// group bound): at M = 16, 147 groups bound for ~27 live ones in the step, so ~2,000 empty blocks drain
// after the live ones (~5 µs, 2026-12-01-bench_moe-session11-h200.md). Here each lane copies its own bytes
// of the next chunks (weights, scales, its token's activations) into a lane-private ring slot with
// cp.async, so bytes in flight cost shared memory instead of registers, and the grid is at most one wave:
// blocks loop over the groups (grp += gridDim.y), so blocks past the live groups are at most one wave.
//
// Same work split, fragments and mma order as gemm_kernel<RT, 1, 8, 1, true, *> (each warp its k range in
// chunk order, the 8 warps summed in warp order, the shared expert one tile at a time with the same
// per-tile mma sequence): bit-identical to it.
//
// Legality: cp.async (4 and 16 bytes), mma.sync.m16n8k16, griddepcontrol: sm_90a and sm_120a; dynamic shared
// memory 32 x kStagedLaneBytes x 8 warps = 72 KB per block at RT = 2 (<= 99 KB: sm_120's per-block limit).

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "moe_mma.cuh"
#include "pdl.cuh"

#ifndef MOE_TRACE
#define MOE_TRACE(table, k)
#endif

namespace k26_moe {

constexpr int kStagedWarps = 8;   // warps of a block, splitting K (as the register GEMM's WK)
constexpr int kStagedStages = 4;  // ring slots per warp: 3 chunks in flight while one is multiplied

// Bytes of one ring slot for one lane: RT weight words (16 B each), RT scale words (4 B), the lane's token's
// 32 activation bytes of the chunk.
template <int RT>
__host__ __device__ constexpr int staged_slot_bytes() { return RT * 16 + RT * 4 + 32; }
template <int RT>  // one warp's ring
__host__ __device__ constexpr int staged_warp_bytes() { return 32 * kStagedStages * staged_slot_bytes<RT>(); }
template <int RT>
__host__ __device__ constexpr int staged_smem_bytes() { return kStagedWarps * staged_warp_bytes<RT>(); }

// The asm statements carry a memory clobber: ring slots are read with plain loads, which must stay between
// the wait that makes them valid and the copy that next overwrites them.
__device__ __forceinline__ void ring_cp16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void ring_cp4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void ring_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N_>
__device__ __forceinline__ void ring_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N_) : "memory"); }

// One warp's k range [c_begin, c_end) of RT interleaved gate/up tiles (tile_base: the first tile's chunk 0)
// for the 8 token columns brow (nullptr: padding column), accumulated into acc in chunk order. ring: this
// warp's slots (kStagedStages x 32 lanes x staged_slot_bytes). Leaves no copy pending.
template <int RT>
__device__ __forceinline__ void staged_chunks(const uint4* __restrict__ w, const uint32_t* __restrict__ s,
                                              size_t tile_base, int KC, int c_begin, int c_end,
                                              const uint4* brow, const void* any_valid, char* ring,
                                              float (&acc)[RT][1][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  constexpr int SLOT = 32 * staged_slot_bytes<RT>();  // one slot for the whole warp
  // Slot layout (each lane reads back only what it copied: no warp synchronisation):
  //   [RT][32 lanes] 16 B weights | [2][32 lanes] 16 B activations | [RT][32 lanes] 4 B scales
  auto w_at = [&](int slot, int r) { return ring + slot * SLOT + (r * 32 + lane) * 16; };
  auto b_at = [&](int slot, int q) { return ring + slot * SLOT + RT * 512 + (q * 32 + lane) * 16; };
  auto s_at = [&](int slot, int r) { return ring + slot * SLOT + RT * 512 + 1024 + (r * 32 + lane) * 4; };
  auto issue = [&](int c, int slot) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const size_t chunk = tile_base + (size_t)r * KC + c;
      ring_cp16(w_at(slot, r), w + chunk * 32 + lane, true);
      ring_cp4(s_at(slot, r), s + chunk * 16 + 2 * g + (t >> 1));  // rows g, g+8 of group t/2
    }
#pragma unroll
    for (int q = 0; q < 2; ++q)  // a padding column's bytes are zero-filled (source size 0)
      ring_cp16(b_at(slot, q), brow != nullptr ? brow + c * 8 + q : any_valid, brow != nullptr);
  };
  const int n = c_end - c_begin;
#pragma unroll
  for (int i = 0; i < kStagedStages - 1; ++i) {
    if (i < n) issue(c_begin + i, i);
    ring_commit();  // empty groups too: the wait below counts groups
  }
  for (int i = 0; i < n; ++i) {
    ring_wait<kStagedStages - 2>();  // chunk i has landed
    const int slot = i % kStagedStages;
    uint4 wv[RT];
    uint32_t sv[RT];
    uint4 bv[1][2];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      wv[r] = *reinterpret_cast<const uint4*>(w_at(slot, r));
      sv[r] = *reinterpret_cast<const uint32_t*>(s_at(slot, r));
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) bv[0][q] = *reinterpret_cast<const uint4*>(b_at(slot, q));
    mma_chunk<RT, 1>(wv, sv, bv, acc);
    // The slot chunk i - 1 used is free (its values fed the mma above in program order).
    if (i + kStagedStages - 1 < n) issue(c_begin + i + kStagedStages - 1, (i + kStagedStages - 1) % kStagedStages);
    ring_commit();
  }
  ring_wait<0>();
}

// grid (I / 8 / RT, Gy <= the table's G groups), 256 threads, staged_smem_bytes<RT>() dynamic shared memory.
// Arguments as gemm_kernel's (GATED: out = act [slot, I]); no `direct` ids (M = 1 keeps gemm_kernel).
template <int RT>
static __global__ void __launch_bounds__(32 * kStagedWarps) gate_up_staged(
    const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ w, const uint32_t* __restrict__ s, int K,
    int n_tiles, int topk, const int* __restrict__ sorted, const int* __restrict__ grp_expert,
    const int* __restrict__ grp_start, const int* __restrict__ grp_len, const int* __restrict__ num_groups,
    __nv_bfloat16* __restrict__ out, int out_ld, int E, int P, int S, const __nv_bfloat16* __restrict__ sa,
    const __nv_bfloat16* __restrict__ sb) {
  extern __shared__ __align__(16) char staged_ring[];
  constexpr int gt = 8;
  const int lane = threadIdx.x & 31, wk = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile0 = blockIdx.x * RT;
  const bool active = tile0 < n_tiles;  // n_tiles is a multiple of RT
  const int KC = K >> 6, c_begin = wk * KC / kStagedWarps, c_end = (wk + 1) * KC / kStagedWarps;
  char* ring = staged_ring + wk * staged_warp_bytes<RT>();
  const int shared_groups = (S + gt - 1) / gt;
  // PDL as gemm_kernel: blocks starting on a shared-expert group let the down GEMM launch at once; the others
  // wait for the routing before reading the table and then let it launch. Writes wait in any case.
  bool waited = false;
  if (blockIdx.y < shared_groups) pdl_trigger();
  int ng = -1;  // the live groups, read once (after the wait)
  for (int grp = blockIdx.y;; grp += gridDim.y) {
    MOE_TRACE(0, 0);
    const bool shared = grp < shared_groups;
    int e = E, start = P + grp * gt, len = min(gt, S - grp * gt);
    if (!shared) {
      if (!waited) {
        pdl_wait();
        pdl_trigger();
        waited = true;
      }
      if (ng < 0) ng = __ldcg(num_groups);
      if (grp >= ng) break;
      e = __ldcg(grp_expert + grp), start = __ldcg(grp_start + grp), len = __ldcg(grp_len + grp);
    }
    MOE_TRACE(0, 1);
    // Activation row of the token in column g (nullptr: padding column, contributes 0).
    const uint4* brow = nullptr;
    if (g < len) {
      const int slot = start + g;
      const size_t row = shared ? (size_t)(slot - P) : (size_t)(__ldcg(sorted + slot) / topk);
      brow = reinterpret_cast<const uint4*>(x + row * K) + 2 * t;
    }
    float acc[RT][1][4];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][0][i] = 0.f;
    if (active && shared) {
      const uint4* brows[1] = {brow};
#pragma unroll
      for (int r = 0; r < RT; ++r)  // one tile at a time: each tile's mma sequence as gemm_kernel's
        shared_acc<1, 1, true>(sa, sb, K, tile0 + r, c_begin, c_end, brows,
                               reinterpret_cast<float(&)[1][1][4]>(acc[r]));
    } else if (active) {
      staged_chunks<RT>(w, s, ((size_t)e * n_tiles + tile0) * KC, KC, c_begin, c_end, brow, x, ring, acc);
    }
    // The 8 warps' partial sums meet in each warp's (now idle) ring, summed in warp order by warp 0.
    float* red = reinterpret_cast<float*>(ring);
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[(r * 4 + i) * 32 + lane] = acc[r][0][i];
    __syncthreads();
    MOE_TRACE(0, 2);
    if (!waited) pdl_wait(), waited = true;  // shared-expert groups computed early; written once allowed
    if (wk == 0 && active) {
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float v = 0.f;
#pragma unroll
          for (int q = 0; q < kStagedWarps; ++q)
            v += reinterpret_cast<const float*>(staged_ring + q * staged_warp_bytes<RT>())[(r * 4 + i) * 32 + lane];
          acc[r][0][i] = v;
        }
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // token columns 2t and 2t+1
          const int n = 2 * t + h;
          if (n >= len) continue;
          // Rows g / g+8 of the tile are gate / up of feature (tile*8 + g); reference rounding points.
          const float gate = bf16_round(acc[r][0][h]), up = bf16_round(acc[r][0][2 + h]);
          const float act = bf16_round(gate / (1.f + __expf(-gate)));
          out[(size_t)(start + n) * out_ld + (tile0 + r) * 8 + g] = __float2bfloat16(act * up);
        }
    }
    MOE_TRACE(0, 3);
    __syncthreads();  // warp 0 has read every ring before the next group's copies overwrite them
  }
}

}  // namespace k26_moe
