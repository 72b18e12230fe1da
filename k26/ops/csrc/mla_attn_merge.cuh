// The split-KV merge of the MLA tree-attention kernel (csrc/mla_tree_attn_kernel.cuh), in the same launch and
// in one level: every live split of a row tile writes its normalised partial (fp32 o, lse) to the workspace,
// the splits meet at a barrier of their own, then each merges an equal share of the tile's output over every
// split.
//
// Why one level: the two-level merge before it (clusters of 8 through distributed shared memory, then the
// last block of each column slice over the clusters) was a chain of five latency steps after the key loop —
// cluster barrier, remote reads, global hand-off, counter, final merge — ~8 µs of the 14 µs 4K decode call
// (2026-12-01-bench_tree_attn-merge-h200.md). Here the merge is barrier + one round of loads at decode
// shapes (a split's items' partials and lse values all issued together, combined online), and its L2 reads
// are spread over as many blocks as there are partials at any length. Measured (H200, cold L2, graph replay,
// 2026-12-04-bench_tree_attn-flat-merge-h200.md): 4K decode 13.8 -> 10.1 µs, 128K 65 -> 54 µs, N = 16 at 4K
// 23.9 -> 20.6 µs; in the compiled 61-layer decode step 15.7 -> 12.2 µs a layer. Phases at 4K decode: key
// loop done 4.6 µs, barrier passed 6.1, loads in 7.9, merged 8.5. Tried and dropped: partials staged
// through shared memory and stored in whole row runs, with an item-major merge (coalesced reads): 0.2-0.6 µs
// slower; a release reduction for the arrival instead of fence + relaxed reduction: the same; weak partial
// stores and L1-allocating merge loads (not .cg) with the group choice by shifts: 0.4-1.1 µs slower (the
// barrier's fence waits longer for weak stores).
//
// The barrier needs every live split of the tile resident: the launch plan keeps the grid within one wave
// (k26_mla_tree_attn_plan), and a programmatic dependent's blocks start only once every block of this grid
// has started (each has passed its trigger), so they cannot take the slots of a waiting split.
//
// Legality: plain loads, ld.acquire, atomics and warp shuffles: sm_90a and sm_120a.

#pragma once

#include "mla_attn_common.cuh"

namespace k26_attn {

#ifndef MERGE_LOADS
#define MERGE_LOADS 8  // partials (float4 + lse) in flight per thread in the merge
#endif
// -DK26_ATTN_MERGE_LOADS_32=24 (a variant for an A/B, k26/ops/build.py VARIANTS): 32-row tiles (MT 2: verify and
// trees) merge with that many loads in flight a thread. At N = 16 and 4K a split merges 124 items over 33
// partials: with 8 loads a thread that is 3 dependent rounds of L2 loads (~1.2 µs each, attn_trace.py: barrier
// passed -> loads used 3.6 µs); with 17 or more, one. MT 2's kernel has the registers (MT 1's 128 do not).
#ifndef K26_ATTN_MERGE_LOADS_32
#define K26_ATTN_MERGE_LOADS_32 MERGE_LOADS
#endif
// The wide verify tile's 64 rows (csrc/mla_tree_attn_wide.cuh) merge with 24: twice the items of a 32-row tile
// per split (N = 16 at 4K: 126 items over 65 partials a split, 5 dependent rounds with 8, 2 with 24), and its
// 254-register budget has room.
template <int BM>
constexpr int kMergeLoads = BM == 32 ? K26_ATTN_MERGE_LOADS_32 : BM == 64 ? 24 : MERGE_LOADS;

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A row tile's merge barrier, bar[0 .. 3): the generation g, then two arrival counts used by g's parity.
// Invariant at a call's start: count[g & 1] == 0. The splits arrive on count[g & 1] (a reduction, no round
// trip back) and wait until it reaches the live split count; split 0 then zeroes the other count (last used
// by the call before, which has completed) and advances g. Every split reads g before arriving, and g moves
// only after every split has arrived, so all of a call's splits use one count. Kernel-owned: graph replays
// need no reset, and a later call may have another arrival count (the live splits follow the length).
// `gen`: bar[0], read by thread 0 before the block's partial stores (a relaxed load: the stores need not
// wait for it; the fence below orders it before the arrival).
__device__ __forceinline__ void tile_barrier(int* bar, unsigned gen, int arrivals, bool first) {
  __syncthreads();  // the block's partial stores are issued
  if (threadIdx.x == 0) {
    int* count = bar + 1 + (gen & 1);
    // (red.release.gpu in place of fence + relaxed reduction measured the same, 2026-12-04)
    __threadfence();  // release, cumulative over the block barrier: every thread's partial before the arrival
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(count) : "memory");
    while (ld_acquire(count) < arrivals) {
    }
    if (first) {
      bar[1 + ((gen + 1) & 1)] = 0;
      bar[0] = (int)(gen + 1u);  // wraps (only its parity is used); the next call starts after this one has
                                 // completed: plain stores suffice
    }
  }
  __syncthreads();  // the acquire extends to the block
}

// Online log-sum-exp state: sum_k e^lse_k o_k = e^m acc and sum_k e^lse_k = e^m s.
struct Lse4 {
  float m, s;  // empty: -inf, 0
  float4 acc;

  __device__ __forceinline__ void add(float m2, float s2, float4 a2) {
    const float mx = fmaxf(m, m2);
    if (mx == -CUDART_INF_F) return;  // both empty
    const float c1 = __expf(m - mx), c2 = __expf(m2 - mx);
    s = s * c1 + s2 * c2;
    acc = make_float4(acc.x * c1 + a2.x * c2, acc.y * c1 + a2.y * c2, acc.z * c1 + a2.z * c2,
                      acc.w * c1 + a2.w * c2);
    m = mx;
  }
};

// Threads per output item (a power of two <= 32, a group of lanes of one warp) for n items over `parts`
// partials: the fewest dependent rounds, passes over the items x batches of LOADS loads a thread.
template <int LOADS>
__device__ __forceinline__ int merge_group(int n, int parts) {
  int best = 1, best_cost = 1 << 30;
  for (int G = 1; G <= 32; G *= 2) {
    const int passes = (n * G + THREADS - 1) / THREADS;
    const int batches = ((parts + G - 1) / G + LOADS - 1) / LOADS;
    if (passes * batches < best_cost) best = G, best_cost = passes * batches;
  }
  return best;
}

// After the barrier: this split's share of the tile's output — float4 items [i0, i1) of its rows_real x 512
// values in row-major order — merged over the `parts` partials (lp: [S][BM] lse, op: [S][BM][512]), the
// final bf16 values into out (the tile's first row) and each row's lse into lse. A fixed order for a given
// (parts, rows): deterministic. Not inlined: the key loop keeps MT 1's 128-register budget to itself.
template <int BM>
__device__ __noinline__ void merge_share(const float* lp, const PartT* op, __nv_bfloat16* out, float* lse,
                                         int parts, int rows_real, int share, int shares) {
  constexpr int C4 = DV / 4, LOADS = kMergeLoads<BM>;
  const int items = rows_real * C4;
  const int i0 = share * items / shares, i1 = (share + 1) * items / shares;  // < 2^31: items <= 8192, shares <= 1024
  const int G = merge_group<LOADS>(i1 - i0, parts), per_pass = THREADS / G, kg = threadIdx.x % G;
  const int passes = (i1 - i0 + per_pass - 1) / per_pass;
  for (int pass = 0; pass < passes; ++pass) {  // uniform across the block: the shuffles below need whole warps
    const int item = i0 + pass * per_pass + threadIdx.x / G;
    const bool live = item < i1;
    const int r = live ? item / C4 : 0, c = live ? (item % C4) * 4 : 0;
    Lse4 st{-CUDART_INF_F, 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
    for (int k0 = kg; live && k0 < parts; k0 += G * LOADS) {
      float l[LOADS];
      float4 v[LOADS];
#pragma unroll
      for (int j = 0; j < LOADS; ++j) {
        const int k = k0 + j * G;
        l[j] = k < parts ? __ldcg(lp + k * BM + r) : -CUDART_INF_F;
        if (k < parts) v[j] = load_part4(op + ((size_t)k * BM + r) * DV + c);
      }
#pragma unroll
      for (int j = 0; j < LOADS; ++j)
        if (l[j] != -CUDART_INF_F) st.add(l[j], 1.f, v[j]);  // an empty partial (no visible key) adds nothing
    }
    if (pass == 0) TRACE(4);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      if (off >= G) continue;
      const float m2 = __shfl_xor_sync(0xffffffffu, st.m, off), s2 = __shfl_xor_sync(0xffffffffu, st.s, off);
      float4 a2;
      a2.x = __shfl_xor_sync(0xffffffffu, st.acc.x, off), a2.y = __shfl_xor_sync(0xffffffffu, st.acc.y, off);
      a2.z = __shfl_xor_sync(0xffffffffu, st.acc.z, off), a2.w = __shfl_xor_sync(0xffffffffu, st.acc.w, off);
      st.add(m2, s2, a2);
    }
    if (pass == 0) TRACE(5);
    if (live && kg == 0) {
      const float inv = st.s > 0.f ? 1.f / st.s : 0.f;
      __nv_bfloat16* o = out + (size_t)r * DV + c;
      *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(st.acc.x * inv, st.acc.y * inv);
      *reinterpret_cast<__nv_bfloat162*>(o + 2) = __floats2bfloat162_rn(st.acc.z * inv, st.acc.w * inv);
      if (c == 0) lse[r] = st.s > 0.f ? st.m + __logf(st.s) : -CUDART_INF_F;
    }
  }
  TRACE(7);
}

// Where split `split` of row tile rt of sequence b puts its normalised partial: the tile's rows of the output
// and lse when it is the sequence's only split, else its slots in the workspace; the tile's barrier and its
// generation, read by thread 0 before the block's partial stores (a relaxed load the stores need not wait for).
template <int BM>
struct SplitOut {
  int rows_real;  // the tile's rows that exist (the last tile may be part-filled)
  int* bar;
  unsigned gen;   // thread 0's only
  __nv_bfloat16* out;
  float *lse, *lp;
  PartT* op;
  __device__ __forceinline__ SplitOut(const Params& p, int b, int rt, int active, int tid) {
    const int row0 = rt * BM;
    rows_real = min(BM, p.R - row0);
    const size_t tile = (size_t)b * p.RT + rt;
    bar = p.counters + 4 * tile;
    gen = active > 1 && tid == 0 ? ld_relaxed(bar) : 0;
    out = p.out + ((size_t)b * p.R + row0) * DV;
    lse = p.lse + (size_t)b * p.R + row0;
    lp = p.lse_part + tile * p.S_max * BM;
    op = p.o_part + tile * p.S_max * BM * DV;
  }
  // Row r's lse, natural log, from its running max m and sum l in the exp2 domain (-inf: an empty row).
  __device__ __forceinline__ void put_lse(int r, int split, int active, float m, float l) const {
    const float v = l > 0.f ? (m + __log2f(l)) * 0.69314718055994531f : -CUDART_INF_F;
    if (active == 1)
      lse[r] = v;
    else
      __stcg(lp + split * BM + r, v);
  }
};

// The split's end: its rows' sums reduced over their lanes, then its normalised partial straight from the
// registers (the final bf16 output when the split is the sequence's only one, else fp32 into the workspace)
// and, unless W_UV's kernel merges (kDeferMT), the tile's barrier and this split's share of the merge.
template <int MT>
__device__ __forceinline__ void finish_split(const Params& p, const BlockSmem<MT>& sm, const Roles& ro,
                                             const float (&o)[MT][8][4], float m_run, float l_run, int rt, int split,
                                             int b, int active) {
  constexpr int BM = 16 * MT, LPR = 16 / MT;
  const int tid = ro.tid, warp = ro.warp, g = ro.g, t = ro.t, sr = ro.sr;
  float* const sM = sm.sM;
  float* const sL = sm.sL;
#pragma unroll
  for (int off = LPR / 2; off > 0; off >>= 1) l_run += __shfl_xor_sync(0xffffffffu, l_run, off);
  if (tid % LPR == 0) sM[sr] = m_run, sL[sr] = l_run;
  __syncthreads();

  const SplitOut<BM> so(p, b, rt, active, tid);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = m * 16 + g + hh * 8;
      if (r >= so.rows_real) continue;
      const float l = sL[r], inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int c = warp * 64 + n * 8 + 2 * t;
        const float2 v = make_float2(o[m][n][2 * hh] * inv, o[m][n][2 * hh + 1] * inv);
        if (active == 1)
          *reinterpret_cast<__nv_bfloat162*>(so.out + (size_t)r * DV + c) = __float22bfloat162_rn(v);
        else
          store_part2(so.op + ((size_t)split * BM + r) * DV + c, v);
      }
    }
  }
  if (tid < so.rows_real) so.put_lse(tid, split, active, sM[tid], sL[tid]);
  if (active == 1) return;
  if (MT <= kDeferMT && active <= p.defer_max) return;  // merged by W_UV's kernel (csrc/mla_merge_uv.cuh)
#ifdef K26_ATTN_PROBE_NO_MERGE
  // measurement only, wrong output: the step's time without the barrier + merge (an upper bound). A
  // condition the compiler cannot decide keeps the merge's code, and so the register allocation, of the default
  if (active > 0) return;
#endif
  tile_barrier(so.bar, so.gen, active, split == 0);
  TRACE(3);
  merge_share<BM>(so.lp, so.op, so.out, so.lse, active, so.rows_real, split, active);
}

}  // namespace k26_attn
