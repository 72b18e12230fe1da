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
// The frontier (<= budget + 1 entries) is kept sorted, best first, in shared memory (double-buffered): a pop
// takes entry 0 and moves every other entry once, to its index - 1 + (how many of the two pushed entries beat
// it), each lane comparing its own entries with the two new ones; the new ones go where the ballots of those
// compares say. No warp-wide argmax a pop (the first version, a register frontier reduced by redux.sync
// word by word, took ~0.54 µs a pop on an H100: budget 64 at depth 15 40.3 µs).
// The key is integer throughout: the score's fp64 bits mapped to an unsigned order (fp64 compares run at
// 1/64 of the fp32 rate on sm_120), then (15 - depth) and the complemented rank tuple (6 bits a depth, so
// the smaller tuple is the larger key): distinct for distinct nodes. fp64 arithmetic is only the two sums a
// pop pushes.
//
// Legality: warp ballots and shared memory only: sm_90a and sm_120a.

#pragma once

#include <stdint.h>

namespace ddtree_heap {

constexpr int kMaxBudget = 64;  // ranks < 64: 6 bits a depth, 15 depths in 90 bits
constexpr int kSlots = (kMaxBudget + 1 + 31) / 32;  // frontier entries a lane owns
constexpr int kEntries = kMaxBudget + 2;              // the frontier's capacity (<= budget + 1 used)
constexpr uint64_t kLow60 = (1ull << 60) - 1, kLow30 = (1ull << 30) - 1;

// The sorted frontier, two buffers (one read, one written a pop), struct of arrays: order key (k, c1, c2),
// parent's score, meta word (parent | depth << 8 | rank << 12 | (score is -0.0) << 18).
struct Frontier {
  uint64_t k[2][kEntries], c1[2][kEntries];
  double ps[2][kEntries];
  uint32_t c2[2][kEntries];
  int meta[2][kEntries];
};

struct Entry {
  uint64_t k, c1;
  uint32_t c2;
  double ps;
  int meta;
};

__device__ __forceinline__ Entry load(const Frontier& f, int b, int i) {
  return Entry{f.k[b][i], f.c1[b][i], f.c2[b][i], f.ps[b][i], f.meta[b][i]};
}
__device__ __forceinline__ void store(Frontier& f, int b, int i, const Entry& e) {
  f.k[b][i] = e.k, f.c1[b][i] = e.c1, f.c2[b][i] = e.c2, f.ps[b][i] = e.ps, f.meta[b][i] = e.meta;
}

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
// The score back from its key (and the -0.0 bit): an entry keeps no score of its own.
__device__ __forceinline__ double key_score(uint64_t k, bool neg_zero) {
  const uint64_t b = neg_zero ? 1ull << 63 : (k >> 63) ? k & ~(1ull << 63) : ~k;
  return __longlong_as_double(static_cast<long long>(b));
}

// The key's tie part: c1 = (15 - depth) << 60 | ~(ranks of depths 1..10), c2 = ~(ranks of depths 11..15).
__device__ __forceinline__ uint64_t rank_unit(int d, bool hi) {  // rank + 1 at depth d, in c1 (hi) or c2
  return hi ? 1ull << (6 * (10 - d)) : 1ull << (6 * (15 - d));
}

__device__ __forceinline__ bool greater(uint64_t k, uint64_t c1, uint32_t c2, uint64_t bk, uint64_t bc1,
                                        uint32_t bc2) {
  return k != bk ? k > bk : c1 != bc1 ? c1 > bc1 : c2 > bc2;
}

__device__ __forceinline__ bool greater(const Entry& a, const Entry& b) {
  return greater(a.k, a.c1, a.c2, b.k, b.c1, b.c2);
}

// Warp 0 of the block: pops up to `budget` nodes from log-probabilities lp [L][lds] (the first min(K, budget)
// of each depth read, all finite) into `out` (nodes 1..n), returns n. Lane l owns frontier entries 1 + l + 32 q.
__device__ int build(const float* lp, int lds, int L, int K, int budget, Nodes out, Frontier& f) {
  const int lane = threadIdx.x & 31;
  const int KU = K < budget ? K : budget;
  if (lane == 0) {  // depth 1, rank 0, parent the root
    const double s0 = static_cast<double>(lp[0]);
    const int m0 = 1 << 8 | is_neg_zero(s0) << 18;
    store(f, 0, 0, Entry{order_key(s0), (14ull << 60) | kLow60, uint32_t(kLow30), 0.0, m0});
  }
  __syncwarp();
  int nf = 1, n = 0, b = 0;
  while (n < budget && nf > 0) {
    const Entry h = load(f, b, 0);
    Entry e[kSlots];
#pragma unroll
    for (int q = 0; q < kSlots; ++q)
      if (1 + lane + 32 * q < nf) e[q] = load(f, b, 1 + lane + 32 * q);
    const double s = key_score(h.k, (h.meta >> 18) & 1);
    const int p = h.meta & 0xff, d = (h.meta >> 8) & 0xf, r = (h.meta >> 12) & 0x3f, node = ++n;
    if (lane == 0) out.score[node] = s, out.parent[node] = p, out.depth[node] = d, out.rank[node] = r;
    // Next sibling: the parent's score plus the next rank's log-probability (depth 1: the log-probability
    // itself, as the reference's first beam); first child: this score plus the next depth's best.
    const bool sib = r + 1 < KU, child = d < L;
    Entry se{}, ce{};
    if (sib) {
      const double lv = static_cast<double>(lp[(size_t)(d - 1) * lds + r + 1]);
      const double ss = d == 1 ? lv : h.ps + lv;
      const bool hi = d <= 10;
      const int m = p | d << 8 | (r + 1) << 12 | is_neg_zero(ss) << 18;
      se = Entry{order_key(ss), hi ? h.c1 - rank_unit(d, true) : h.c1,
                 hi ? h.c2 : h.c2 - uint32_t(rank_unit(d, false)), h.ps, m};
    }
    if (child) {
      const double cs = s + static_cast<double>(lp[(size_t)d * lds]);
      ce = Entry{order_key(cs), h.c1 - (1ull << 60), h.c2, s, node | (d + 1) << 8 | is_neg_zero(cs) << 18};
    }
    // Every other entry moves to i - 1 + (pushed entries that beat it); the pushed ones after the entries that
    // beat them (node keys are distinct: one of any two is greater).
    int before_sib = 0, before_child = 0;
#pragma unroll
    for (int q = 0; q < kSlots; ++q) {
      const int i = 1 + lane + 32 * q;
      const bool mine = i < nf;
      const bool bs = mine && sib && greater(se, e[q]), bc = mine && child && greater(ce, e[q]);
      before_sib += __popc(__ballot_sync(~0u, mine && sib && !bs));
      before_child += __popc(__ballot_sync(~0u, mine && child && !bc));
      if (mine) store(f, b ^ 1, i - 1 + bs + bc, e[q]);
    }
    if (sib && lane == 0) store(f, b ^ 1, before_sib + (child && greater(ce, se)), se);
    if (child && lane == 1) store(f, b ^ 1, before_child + (sib && greater(se, ce)), ce);
    nf += sib + child - 1;
    b ^= 1;
    __syncwarp();  // the next pop reads what this one wrote
  }
  return n;
}

}  // namespace ddtree_heap
