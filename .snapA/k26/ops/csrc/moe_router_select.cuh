// Phase 2 of the fused MoE router (csrc/moe_router.cu, which includes this): from one token's scores and
// choices in shared memory to its top-k ids and weights. group_mask (n_group > 1), topk_fast (topk <= 8:
// redux.sync picks over register-held keys, per warp then over the warps' candidates) and topk_serial (any
// topk <= 32: one warp's serial picks), write_choice (renormalised, scaled weights). The block shape
// (kThreads) is the router kernel's; TRACE(k) stamps phases when the includer defines it.
//
// Legality: warp shuffles, redux.sync, ballots and shared memory only (sm_80+): sm_90a and sm_120a.

#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#ifndef TRACE
#define TRACE(k)
#endif

namespace router_select {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxE = 1024;   // experts held in shared memory by phase 2
constexpr int kMaxTopk = 32;  // one lane per chosen expert when writing the outputs
constexpr int kMaxGroups = 32;

// What phase 2 needs of the router's arguments.
struct Selection {
  float* out_w;      // [M, topk]
  int64_t* out_ids;  // [M, topk]
  int E, n_group, topk_group, topk, renormalize;
  float scale;
};

// Warp argmax over (value, index): larger value wins, ties go to the lower index; NaN marks "taken".
__device__ __forceinline__ void warp_argmax(float& v, int& idx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (oi >= 0 && (idx < 0 || ov > v || (ov == v && oi < idx))) v = ov, idx = oi;
  }
}

// Float -> uint32 with the same order (NaN, used for "taken", below everything, -inf included).
__device__ __forceinline__ uint32_t order_key(float f) {
  if (isnan(f)) return 0u;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ void local_best(const float* choice, int E, int lane, uint32_t& key, int& idx) {
  key = 0u, idx = -1;
  for (int e = lane; e < E; e += 32) {
    const uint32_t k = order_key(choice[e]);
    if (k > key) key = k, idx = e;  // ascending e: a lane's ties keep its lower index
  }
}

// One warp: keep only the topk_group groups with the largest sum of their two best choices (n_group > 1);
// experts of dropped groups get -inf, so they can only be chosen after every kept one (as the reference).
__device__ void group_mask(const Selection& a, float* choice) {
  const int lane = threadIdx.x & 31, gs = a.E / a.n_group;
  float gscore = -INFINITY;
  for (int gi = 0; gi < a.n_group; ++gi) {
    float b1 = -INFINITY, b2 = -INFINITY;  // this lane's two best of the group
    for (int e = gi * gs + lane; e < (gi + 1) * gs; e += 32) {
      const float v = choice[e];
      if (v > b1) b2 = b1, b1 = v; else if (v > b2) b2 = v;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float o1 = __shfl_xor_sync(0xffffffffu, b1, o), o2 = __shfl_xor_sync(0xffffffffu, b2, o);
      if (o1 > b1) b2 = fmaxf(b1, o2), b1 = o1; else b2 = fmaxf(b2, o1);
    }
    if (lane == gi) gscore = b1 + b2;
  }
  uint32_t keep = 0;
  for (int k = 0; k < a.topk_group; ++k) {
    float v = (lane < a.n_group && !(keep >> lane & 1)) ? gscore : -INFINITY;
    int idx = (lane < a.n_group && !(keep >> lane & 1)) ? lane : -1;
    warp_argmax(v, idx);
    if (idx >= 0) keep |= 1u << idx;
  }
  for (int e = lane; e < a.E; e += 32)
    if (!(keep >> (e / gs) & 1)) choice[e] = -INFINITY;
}

// One warp, lane k holding the k-th chosen expert `mine` (k < topk): the weights, summed in k order.
__device__ void write_choice(const Selection& a, const float* score, int tok, int mine) {
  const int lane = threadIdx.x & 31;
  const float s = lane < a.topk ? score[mine] : 0.f;
  float sum = 0.f;  // in k order, as every lane sees the same sequence
  for (int k = 0; k < a.topk; ++k) sum += __shfl_sync(0xffffffffu, s, k);
  if (lane < a.topk) {
    const float w = a.renormalize ? s / (sum + 1e-20f) : s;
    a.out_w[(size_t)tok * a.topk + lane] = w * a.scale;
    a.out_ids[(size_t)tok * a.topk + lane] = mine;
  }
}

// One warp, any topk <= 32: per pick one redux.sync finds the best key among the lanes' own bests
// (e ≡ lane mod 32), the lowest lane holding it gives its expert, and only that lane rescans its experts.
// A serial chain of topk picks (~2 µs for 8 of 384): used only where topk > kFastTopk.
__device__ void topk_serial(const Selection& a, float* choice, const float* score, int tok) {
  const int lane = threadIdx.x & 31;
  uint32_t key;
  int idx;
  local_best(choice, a.E, lane, key, idx);
  int mine = -1;  // lane k holds the k-th choice
  for (int k = 0; k < a.topk; ++k) {
    const uint32_t best = __reduce_max_sync(0xffffffffu, key);
    const int wl = __ffs(__ballot_sync(0xffffffffu, key == best)) - 1;
    const int win = __shfl_sync(0xffffffffu, idx, wl);
    if (lane == k) mine = win;
    if (lane == wl) {
      choice[win] = NAN;  // taken
      local_best(choice, a.E, lane, key, idx);
    }
  }
  __syncwarp();
  write_choice(a, score, tok, mine);
}

// Top-kFastTopk in two rounds of redux.sync picks, all in registers: each warp picks the best kFastTopk of
// its own experts (thread t holds e = t + 256 j), then warp 0 picks the final kFastTopk from the 64
// candidates. A pick: the best key of the lanes' bests (redux.sync), the lowest lane holding it gives its
// expert and recomputes its best over its few register-held keys. An exact tie of two choices goes to one of
// them, deterministically. (Measured 2026-12-01, H200: ~1.5 µs less than merging sorted 64-bit lists in a
// shuffle butterfly, which spent 1.5 µs in its five rounds alone.)
constexpr int kFastTopk = 8;
constexpr int kPerThread = kMaxE / kThreads;

// `n` picks over each lane's keys key[0..J) (experts id[0..J), key 0 = empty); lane k < n gets the k-th pick.
template <int J>
__device__ __forceinline__ void warp_picks(uint32_t key[J], const int id[J], int n, uint32_t& got_key,
                                           int& got_id) {
  const int lane = threadIdx.x & 31;
  uint32_t best = 0;
  int bj = 0;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (key[j] > best) best = key[j], bj = j;
  got_key = 0, got_id = -1;
  for (int k = 0; k < n; ++k) {
    const uint32_t top = __reduce_max_sync(0xffffffffu, best);
    const int wl = __ffs(__ballot_sync(0xffffffffu, best == top)) - 1;
    int win = 0;
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (j == bj) win = id[j];
    win = __shfl_sync(0xffffffffu, win, wl);
    if (lane == k) got_key = top, got_id = win;
    if (lane == wl) {
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (j == bj) key[j] = 0;
      best = 0, bj = 0;
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (key[j] > best) best = key[j], bj = j;
    }
  }
}

// All threads of the block (one barrier inside); warp 0 writes the outputs.
__device__ void topk_fast(const Selection& a, const float* choice, const float* score, int tok, uint32_t* cand_key,
                          int* cand_id) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t key[kPerThread];
  int id[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int e = threadIdx.x + j * kThreads;
    key[j] = e < a.E ? order_key(choice[e]) : 0u;  // every choice ranks above 0 (NaN became -inf)
    id[j] = e;
  }
  TRACE(6);
  uint32_t k1;
  int i1;
  warp_picks<kPerThread>(key, id, kFastTopk, k1, i1);
  TRACE(7);
  if (lane < kFastTopk) cand_key[warp * kFastTopk + lane] = k1, cand_id[warp * kFastTopk + lane] = i1;
  __syncthreads();
  TRACE(8);
  if (warp != 0) return;
  constexpr int C = kWarps * kFastTopk / 32;  // candidates per lane
  uint32_t ck[C];
  int ci[C];
#pragma unroll
  for (int j = 0; j < C; ++j) ck[j] = cand_key[lane + 32 * j], ci[j] = cand_id[lane + 32 * j];
  uint32_t k2;
  int mine;
  warp_picks<C>(ck, ci, a.topk, k2, mine);
  TRACE(9);
  write_choice(a, score, tok, mine);
  TRACE(10);
}

}  // namespace router_select
