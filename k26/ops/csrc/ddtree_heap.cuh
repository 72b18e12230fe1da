// DDTree construction for small budgets (<= 64 nodes) by one warp's best-first heap: the tree is the first
// `budget` nodes a max-heap over the frontier pops, where popping node (parent p, depth d, rank r) pushes its
// next sibling (p, d, r + 1) and its first child (node, d + 1, 0). The heap pops in the total order of
// k26/spec/tree.py — (score desc, depth asc, rank tuple asc) — because every node's parent and previous
// sibling come before it in that order, so the best remaining node is always on the frontier; the top
// `budget` nodes of that order are the level-by-level reference's (k26/ops/reference.py) whenever the fp64
// sums are exact (fp32 log-probabilities within 2^29 of one another: every input a drafter gives). Work:
// `budget` pops, whatever the depth L (the level-by-level kernel takes L barrier-separated rounds of
// candidate sorts: 45 µs at budget 16, depth 15, on an H200).
//
// The frontier (<= budget + 1 entries) lives in the warp's registers, slots_for(budget) a lane; a pop is each
// lane's best entry, then the warp's best by __reduce_max_sync over the entry's order key, one 32-bit word at a
// time while more than one lane is left (exact fp64 ties fall through to the depth and the rank tuple).
// A pop is one warp's dependent chain (ncu, budget 64: ~1,000 cycles a pop): ~0.54 µs on an H100 with branches
// in it, ~0.45 branch-free (selects), less with one slot a lane (2026-12-06-session31-h100.md). Also tried
// there (261601b, reverted): only the key in registers, the other fields in shared memory (half the
// instructions a pop) — budget 64 4 % faster, 16 and 32 not: the chain's latency, not its issue, bounds it.
// And (9d4e298, reverted): the frontier sorted in shared memory, a pop moving every entry once by the ballots
// of the lanes' compares with the two pushed entries — correct, but ~0.95 µs a pop (budget 64 at depth 15:
// 40.5 -> 67.1 µs; 2026-12-06-moe-groups-tree-heap-session30-h100.md).
// The key is integer throughout: the score's fp64 bits mapped to an unsigned order (fp64 compares run at
// 1/64 of the fp32 rate on sm_120), then (15 - depth) and the complemented rank tuple (6 bits a depth, so
// the smaller tuple is the larger key). fp64 arithmetic is only the two sums a pop pushes.
//
// Legality: warp shuffles, ballot, redux.sync (sm_80+) and shared memory only: sm_90a and sm_120a.

#pragma once

#include <stdint.h>

namespace ddtree_heap {

constexpr int kMaxBudget = 64;  // ranks < 64: 6 bits a depth, 15 depths in 90 bits
// Frontier entries a lane holds for a budget: build<slots_for(budget)>. One slot up to budget 31 (every default
// budget of the adaptive policy): a pop then selects nothing within a lane (budgets 16 / 32, back to back on an
// H100: 9.6 / 16.7 -> 8.0 / 15.6 µs).
__host__ __device__ constexpr int slots_for(int budget) { return (budget + 1 + 31) / 32; }
constexpr uint64_t kLow60 = (1ull << 60) - 1, kLow30 = (1ull << 30) - 1;

// The popped nodes in pop order, index 0 the root (shared memory, kMaxBudget + 1 each).
struct Nodes {
  double* score;
  int* parent;
  int* depth;
  int* rank;
};

// fp64 order as unsigned order; -0.0 and +0.0 equal, as fp64 compares them (the entry keeps a -0.0 bit).
__device__ __forceinline__ uint64_t order_key(double s) {
  uint64_t b = static_cast<uint64_t>(__double_as_longlong(s));
  if ((b << 1) == 0) b = 0;
  return (b >> 63) ? ~b : (b | (1ull << 63));
}
__device__ __forceinline__ bool is_neg_zero(double s) {
  return static_cast<uint64_t>(__double_as_longlong(s)) == (1ull << 63);
}
// The score back from its key (and the -0.0 bit): entries hold no double of their own (registers: sm_120a
// spilled with one).
__device__ __forceinline__ double key_score(uint64_t k, bool neg_zero) {
  const uint64_t b = neg_zero ? 1ull << 63 : (k >> 63) ? k & ~(1ull << 63) : ~k;
  return __longlong_as_double(static_cast<long long>(b));
}

// The key's tie part: c1 = (15 - depth) << 60 | ~(ranks of depths 1..10), c2 = ~(ranks of depths 11..15).
__device__ __forceinline__ uint64_t rank_unit(int d, bool hi) {  // rank + 1 at depth d, in c1 (hi) or c2
  return hi ? 1ull << (6 * (10 - d)) : 1ull << (6 * (15 - d));
}

__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}

// Bitwise, not short-circuit: the pop's chain stays one basic block (selects, no reconverging branches).
__device__ __forceinline__ bool greater(uint64_t k, uint64_t c1, uint32_t c2, uint64_t bk, uint64_t bc1,
                                        uint32_t bc2) {
  return (k > bk) | ((k == bk) & ((c1 > bc1) | ((c1 == bc1) & (c2 > bc2))));
}

// The lane holding the warp's largest (k, c1, c2) among lanes with `has`, or -1 if none has one.
__device__ __forceinline__ int warp_argmax(bool has, uint64_t k, uint64_t c1, uint32_t c2) {
  const int lane = threadIdx.x & 31;
  unsigned cand = __ballot_sync(~0u, has);
  if (cand == 0) return -1;
  const uint32_t words[5] = {uint32_t(k >> 32), uint32_t(k), uint32_t(c1 >> 32), uint32_t(c1), c2};
#pragma unroll
  for (int w = 0; w < 5; ++w) {
    if (__popc(cand) == 1) break;  // warp-uniform
    const bool in = (cand >> lane) & 1;
    const uint32_t m = __reduce_max_sync(~0u, in ? words[w] : 0u);
    cand = __ballot_sync(~0u, in && words[w] == m);
  }
  return __ffs(cand) - 1;
}

// Warp 0 of the block: pops up to `budget` nodes from log-probabilities lp [L][lds] in shared memory (the
// first min(K, budget) of each depth read, all finite) into `out` (nodes 1..n), returns n; kSlots =
// slots_for(budget). An entry carries its key, its parent's score (the next sibling's base: no shared-memory
// round trip inside the loop) and a meta word: parent | depth << 8 | rank << 12 | (score is -0.0) << 18. An
// emptied slot gets the zero key (every finite score's order key is > 0): it loses every compare with a real
// entry, and a lane with no real entry (bk == 0) takes no part in the warp's pick. The loop body is
// branch-free (selects and predicated stores): the first version's branches (a reconvergence per slot compare
// and per slot update) cost ~20 % more a pop.
template <int kSlots>
__device__ int build(const float* lp, int lds, int L, int K, int budget, Nodes out) {
  static_assert(kSlots >= 1 && kSlots <= slots_for(kMaxBudget), "budget + 1 entries, kSlots a lane");
  const int lane = threadIdx.x & 31;
  const int KU = K < budget ? K : budget;
  // lp through its shared-window address: a generic load (what a `const float*` compiles to) costs more
  // latency than ld.shared, and both loads sit on the pop's chain.
  const uint32_t lp_s = static_cast<uint32_t>(__cvta_generic_to_shared(lp));
  uint64_t k[kSlots], c1[kSlots];
  uint32_t c2[kSlots];
  double ps[kSlots];
  int meta[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) meta[s] = 0, k[s] = c1[s] = 0, c2[s] = 0, ps[s] = 0.0;
  if (lane == 0) {  // depth 1, rank 0, parent the root
    const double s0 = static_cast<double>(lp[0]);
    k[0] = order_key(s0), c1[0] = (14ull << 60) | kLow60, c2[0] = uint32_t(kLow30);
    meta[0] = 1 << 8 | is_neg_zero(s0) << 18;
  }
  int count = 1, n = 0;
  while (n < budget) {
    // This lane's best entry, its fields picked by selects (a dynamic index would put the arrays in local memory).
    int best = -1, bm = 0;
    uint64_t bk = 0, bc1 = 0;
    uint32_t bc2 = 0;
    double bps = 0.0;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const bool take = greater(k[s], c1[s], c2[s], bk, bc1, bc2);
      best = take ? s : best, bk = take ? k[s] : bk, bc1 = take ? c1[s] : bc1, bc2 = take ? c2[s] : bc2;
      bps = take ? ps[s] : bps, bm = take ? meta[s] : bm;
    }
    // (bk != 0: an emptied slot keeps its stale tie words, so a lane whose slots are all empty still picks one)
    const int wl = warp_argmax(bk != 0, bk, bc1, bc2);
    if (wl < 0) break;  // every prefix popped (fewer than `budget`)
    const int wslot = __shfl_sync(~0u, best, wl), m = __shfl_sync(~0u, bm, wl);
    const double pscore = __shfl_sync(~0u, bps, wl);
    const uint64_t t0 = __shfl_sync(~0u, bk, wl), t1 = __shfl_sync(~0u, bc1, wl);
    const uint32_t t2 = __shfl_sync(~0u, bc2, wl);
    const double s = key_score(t0, (m >> 18) & 1);
    const int p = m & 0xff, d = (m >> 8) & 0xf, r = (m >> 12) & 0x3f, node = ++n;
    // Next sibling into the popped slot (or the slot empties): the parent's score plus the next rank's
    // log-probability (depth 1: the log-probability itself, as the reference's first beam). Both loads are
    // unconditional (indices clamped into lp): their latency overlaps instead of following a branch.
    const bool sib = r + 1 < KU;
    const double lv = static_cast<double>(lds_f32(lp_s + 4u * ((d - 1) * lds + min(r + 1, KU - 1))));
    const double ss = (d == 1 ? -0.0 : pscore) + lv;  // -0.0: the additive identity, -0.0 + -0.0 included
    const bool child = d < L;
    const double cs = s + static_cast<double>(lds_f32(lp_s + 4u * (min(d, L - 1) * lds)));
    const bool hi = d <= 10;
    const uint64_t s1 = hi ? t1 - rank_unit(d, true) : t1;
    const uint32_t s2 = hi ? t2 : t2 - uint32_t(rank_unit(d, false));
    const uint64_t sk = sib ? order_key(ss) : 0;
    const int sm = p | d << 8 | (r + 1) << 12 | is_neg_zero(ss) << 18;
    // First child into a fresh slot: entries only grow by one a pop, so budget + 1 slots in all.
    const uint64_t ck = order_key(cs);
    const int cm = node | (d + 1) << 8 | is_neg_zero(cs) << 18;
    const int cl = count & 31, cq = count >> 5;
#pragma unroll
    for (int q = 0; q < kSlots; ++q) {
      const bool hs = lane == wl && q == wslot, hc = child && lane == cl && q == cq;
      k[q] = hs ? sk : hc ? ck : k[q];
      c1[q] = hs ? s1 : hc ? t1 - (1ull << 60) : c1[q];
      c2[q] = hs ? s2 : hc ? t2 : c2[q];
      ps[q] = hs ? pscore : hc ? s : ps[q];
      meta[q] = hs ? sm : hc ? cm : meta[q];
    }
    count += child;
    // (After the loads above: the stores' address arithmetic stays off the pop's chain.)
    if (lane == 0) out.score[node] = s, out.parent[node] = p, out.depth[node] = d, out.rank[node] = r;
  }
  return n;
}

}  // namespace ddtree_heap
