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
// A pop is one warp's dependent chain, instruction-bound (ncu, budget 64: ~1,000 cycles a pop, 2026-12-06
// session 31): ~0.54 µs on an H100 with branches in it, ~0.45 branch-free (selects), less with one slot a lane
// (2026-12-06-session31-h100.md). Tried and dropped (9d4e298, reverted): the frontier sorted in shared memory,
// a pop moving every entry once by the ballots of the lanes' compares with the two pushed entries — correct,
// but ~0.95 µs a pop (budget 64 at depth 15: 40.5 -> 67.1 µs;
// 2026-12-06-moe-groups-tree-heap-session30-h100.md).
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
// budget of the adaptive policy): a pop then selects nothing within a lane, ~a third of its instructions.
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

// The lane holding the warp's largest entry among lanes with a best (bk != 0): by its key's two words, and only
// while lanes tie on the whole key (an exact fp64 tie: rare) by the tie words c1 / c2 of each candidate's best
// entry, read from shared memory (entry index best * 32 + lane). -1 if no lane has an entry.
__device__ __forceinline__ int warp_argmax(uint64_t bk, int best, const uint64_t* e_c1, const uint32_t* e_c2) {
  const int lane = threadIdx.x & 31;
  const uint32_t hi = __reduce_max_sync(~0u, uint32_t(bk >> 32));
  if (hi == 0) return -1;  // every finite score's key has a non-zero high word; an empty lane has 0
  unsigned cand = __ballot_sync(~0u, uint32_t(bk >> 32) == hi);
  if (__popc(cand) > 1) {  // warp-uniform
    const bool in = (cand >> lane) & 1;
    const uint32_t lo = __reduce_max_sync(~0u, in ? uint32_t(bk) : 0u);
    cand = __ballot_sync(~0u, in && uint32_t(bk) == lo);
  }
  if (__popc(cand) > 1) {  // the same key: the depth, then the rank tuple decide
    const bool in = (cand >> lane) & 1;
    const uint64_t c1 = in ? e_c1[best * 32 + lane] : 0;
    const uint32_t words[3] = {uint32_t(c1 >> 32), uint32_t(c1), in ? e_c2[best * 32 + lane] : 0u};
#pragma unroll
    for (int w = 0; w < 3; ++w) {
      if (__popc(cand) == 1) break;
      const bool still = (cand >> lane) & 1;
      const uint32_t m = __reduce_max_sync(~0u, still ? words[w] : 0u);
      cand = __ballot_sync(~0u, still && words[w] == m);
    }
  }
  return __ffs(cand) - 1;
}

// Warp 0 of the block: pops up to `budget` nodes from log-probabilities lp [L][lds] in shared memory (the
// first min(K, budget) of each depth read, all finite) into `out` (nodes 1..n), returns n; kSlots =
// slots_for(budget). Entry i of the frontier (i = slot * 32 + lane, in push order) keeps only its order key in
// its lane's registers; its tie words, its parent's score (the next sibling's base) and a meta word (parent |
// depth << 8 | rank << 12 | (score is -0.0) << 18) live in shared memory, written by lane 0, read by every lane
// at the popped entry's index (a broadcast). A pop is then the lanes' best keys (an exact key tie in a lane or
// across lanes reads the tie words: rare), the winner's fields, the two pushes: ~half the instructions of
// holding every field in registers (selects per slot and ten shuffles a pop; ~0.45 µs a pop at three slots,
// 2026-12-06-session31-h100.md). An empty slot has the all-zero key (every finite score's key is > 0).
template <int kSlots>
__device__ int build(const float* lp, int lds, int L, int K, int budget, Nodes out) {
  static_assert(kSlots >= 1 && kSlots <= slots_for(kMaxBudget), "budget + 1 entries, kSlots a lane");
  constexpr int kEntries = 32 * kSlots;
  __shared__ uint64_t e_c1[kEntries];
  __shared__ uint32_t e_c2[kEntries];
  __shared__ double e_ps[kEntries];
  __shared__ int e_meta[kEntries];
  const int lane = threadIdx.x & 31;
  const int KU = K < budget ? K : budget;
  // lp through its shared-window address: a generic load (what a `const float*` compiles to) costs more
  // latency than ld.shared, and both loads sit on the pop's chain.
  const uint32_t lp_s = static_cast<uint32_t>(__cvta_generic_to_shared(lp));
  uint64_t k[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) k[s] = 0;
  if (lane == 0) {  // entry 0: depth 1, rank 0, parent the root
    const double s0 = static_cast<double>(lp[0]);
    k[0] = order_key(s0);
    e_c1[0] = (14ull << 60) | kLow60, e_c2[0] = uint32_t(kLow30), e_ps[0] = 0.0;
    e_meta[0] = 1 << 8 | is_neg_zero(s0) << 18;
  }
  __syncwarp();
  int count = 1, n = 0;
  while (n < budget) {
    // This lane's best entry by key (selects; a dynamic index would put k in local memory).
    int best = -1;
    uint64_t bk = 0;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const bool take = k[s] > bk;
      best = take ? s : best, bk = take ? k[s] : bk;
    }
    if constexpr (kSlots > 1) {
      bool tie = false;  // two of the lane's entries with the same key (an exact fp64 tie): the tie words decide
#pragma unroll
      for (int s = 0; s < kSlots; ++s) tie |= (s != best) & (k[s] == bk) & (bk != 0);
      if (tie) {
        uint64_t bc1 = 0;
        uint32_t bc2 = 0;
        int b2 = -1;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          if (k[s] != bk) continue;
          const uint64_t c1 = e_c1[s * 32 + lane];
          const uint32_t c2 = e_c2[s * 32 + lane];
          if (b2 < 0 || c1 > bc1 || (c1 == bc1 && c2 > bc2)) b2 = s, bc1 = c1, bc2 = c2;
        }
        best = b2;
      }
    }
    const int wl = warp_argmax(bk, best, e_c1, e_c2);
    if (wl < 0) break;  // every prefix popped (fewer than `budget`)
    const int e = __shfl_sync(~0u, best, wl) * 32 + wl;
    const uint64_t t0 = __shfl_sync(~0u, bk, wl);
    const int m = e_meta[e];
    const double pscore = e_ps[e];
    const uint64_t t1 = e_c1[e];
    const uint32_t t2 = e_c2[e];
    const double s = key_score(t0, (m >> 18) & 1);
    const int p = m & 0xff, d = (m >> 8) & 0xf, r = (m >> 12) & 0x3f, node = ++n;
    // Next sibling into the popped entry (or it empties): the parent's score plus the next rank's
    // log-probability (depth 1: the log-probability itself, as the reference's first beam). Both loads are
    // unconditional (indices clamped into lp): their latency overlaps instead of following a branch.
    const bool sib = r + 1 < KU;
    const double lv = static_cast<double>(lds_f32(lp_s + 4u * ((d - 1) * lds + min(r + 1, KU - 1))));
    const double ss = (d == 1 ? -0.0 : pscore) + lv;  // -0.0: the additive identity, -0.0 + -0.0 included
    const bool child = d < L;
    const double cs = s + static_cast<double>(lds_f32(lp_s + 4u * (min(d, L - 1) * lds)));
    const bool hi = d <= 10;
    const uint64_t sk = sib ? order_key(ss) : 0;
    // First child into a fresh entry (`count`): entries only grow by one a pop, so budget + 1 in all.
    const uint64_t ck = order_key(cs);
    const int cl = count & 31, cq = count >> 5;
#pragma unroll
    for (int q = 0; q < kSlots; ++q) {
      const bool hs = lane == wl && e == q * 32 + lane, hc = child && lane == cl && q == cq;
      k[q] = hs ? sk : hc ? ck : k[q];
    }
    __syncwarp();     // every lane has read entry e's fields before lane 0 rewrites them
    if (lane == 0) {  // the two entries' fields (the sibling's parent score is its entry's already)
      if (sib) {
        e_c1[e] = hi ? t1 - rank_unit(d, true) : t1;
        e_c2[e] = hi ? t2 : t2 - uint32_t(rank_unit(d, false));
        e_meta[e] = p | d << 8 | (r + 1) << 12 | is_neg_zero(ss) << 18;
      }
      if (child) e_c1[count] = t1 - (1ull << 60), e_c2[count] = t2, e_ps[count] = s,
                 e_meta[count] = node | (d + 1) << 8 | is_neg_zero(cs) << 18;
      out.score[node] = s, out.parent[node] = p, out.depth[node] = d, out.rank[node] = r;
    }
    count += child;
    __syncwarp();  // the entries' fields written above are read by every lane at the next pop
  }
  return n;
}

}  // namespace ddtree_heap
