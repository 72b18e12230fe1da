// DDTree construction for small budgets (<= 64 nodes) by one warp's best-first search: the tree is the first
// `budget` nodes popped from a frontier ordered as a max-heap, where popping node (parent p, depth d, rank r)
// pushes its next sibling (p, d, r + 1) and its first child (node, d + 1, 0). The pops follow the total order of
// k26/spec/tree.py — (score desc, depth asc, rank tuple asc) — because every node's parent and previous sibling
// come before it in that order, so the best remaining node is always on the frontier; the top `budget` nodes of
// that order are the level-by-level reference's (k26/ops/reference_tree.py) whenever the fp64 sums are exact (fp32
// log-probabilities within 2^29 of one another: every input a drafter gives). Work: `budget` pops, whatever the
// depth L (the level-by-level kernel takes L barrier-separated rounds of candidate sorts: 45 µs at budget 16,
// depth 15, on an H200).
//
// The frontier is a sorted list across the warp, one entry a lane, lane 0 the best. Only its best 32 entries
// are kept: after k pops it holds at most k + 1 entries, so an entry falls off the end only from k = 31 on,
// when at most budget - 32 <= 32 pops are left, and the entry that falls has 32 better ones ahead of it: it
// (and everything it would push) is never popped. A pop takes lane 0's entry, computes the two entries it
// pushes (every lane the same), finds where each goes by one ballot of the lanes' compares with it, and moves
// each lane's entry by one shuffle. The next pop's entry is a select of the pushed two and the old second
// entry (broadcast at the pop's start): the shuffle that rebuilds the list runs beside the next pop's loads,
// off the chain. The pop's chain: two shared-memory loads, an fp64 add, the key, a compare, a ballot; a pop
// issues ~190 instructions (ncu, profiling/debug/ncu_tree.sh), ~0.24 µs on an H100.
// Measured (H100, `bench_tree.py --calls 20`, depth 15, budgets 16 / 32 / 64; 2026-12-06-tree-sorted-frontier-
// session32-h100.md): 8.0 / 15.3 / 30.8 µs with the frontier as an unordered heap (budget + 1 entries over the
// lanes' slots, a pop a warp-wide arg-max by redux.sync over the key's words: ~1,000 cycles a pop), 7.9 / 13.3 /
// 24.4 with this list of eight-word entries, 6.4 / 10.1 / 18.0 with six-word entries (the parent's score read
// from the popped nodes), the log-probabilities widened to fp64 before the pops and the keys masked, not
// branched. Also tried before: the frontier sorted in shared memory, a pop moving every entry by the ballots of
// the lanes' compares (9d4e298: ~0.95 µs a pop).
// The key is integer throughout: the score's fp64 bits mapped to an unsigned order (fp64 compares run at
// 1/64 of the fp32 rate on sm_120), then (15 - depth) and the complemented rank tuple (6 bits a depth, so
// the smaller tuple is the larger key): keys are unique (a node's depth and rank tuple name it), so the
// order is strict. fp64 arithmetic is only the two sums a pop pushes.
//
// Legality: warp shuffles, ballot and shared memory only: sm_90a and sm_120a.

#pragma once

#include <stdint.h>

namespace ddtree_heap {

constexpr int kMaxBudget = 64;  // ranks < 64: 6 bits a depth, 15 depths in 90 bits; 32 lanes keep the frontier
constexpr uint64_t kLow60 = (1ull << 60) - 1, kLow30 = (1ull << 30) - 1;

// The popped nodes in pop order, index 0 the root (shared memory, kMaxBudget + 1 each): the score and the
// entry's meta word (parent | depth << 8 | rank << 12 | ...: node_parent / node_depth / node_rank).
struct Nodes {
  double* score;
  int* meta;
};
__host__ __device__ constexpr int node_parent(int m) { return m & 0xff; }
__host__ __device__ constexpr int node_depth(int m) { return (m >> 8) & 0xf; }
__host__ __device__ constexpr int node_rank(int m) { return (m >> 12) & 0x3f; }

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

// (No "memory" clobber: the popped scores it reads back were stored by this thread iterations earlier, and
// nvcc keeps the volatile asm and the stores in program order — the GPU tests compare every bit. A clobber on
// the score read would make that order a guarantee; left for a session that can measure its schedule.)
__device__ __forceinline__ double lds_f64(uint32_t addr) {
  double v;
  asm volatile("ld.shared.f64 %0, [%1];\n" : "=d"(v) : "r"(addr));
  return v;
}

// Bitwise, not short-circuit: the pop's chain stays one basic block (selects, no reconverging branches).
__device__ __forceinline__ bool greater(uint64_t k, uint64_t c1, uint32_t c2, uint64_t bk, uint64_t bc1,
                                        uint32_t bc2) {
  return (k > bk) | ((k == bk) & ((c1 > bc1) | ((c1 == bc1) & (c2 > bc2))));
}

// A frontier entry: its key (0: empty), its tie words and a meta word: parent | depth << 8 | rank << 12 |
// (score is -0.0) << 18. An empty entry is all zero: it loses every compare with a real one. (No parent's score:
// the sibling's base is read from the popped nodes' scores, beside the log-probability, so the list moves
// six words an entry, not eight.)
struct Entry {
  uint64_t k, c1;
  uint32_t c2;
  int meta;

  __device__ __forceinline__ bool operator>(const Entry& o) const { return greater(k, c1, c2, o.k, o.c1, o.c2); }
  __device__ __forceinline__ Entry shfl(int src) const {
    return {__shfl_sync(~0u, k, src), __shfl_sync(~0u, c1, src), __shfl_sync(~0u, c2, src),
            __shfl_sync(~0u, meta, src)};
  }
  __device__ __forceinline__ Entry pick(bool take, const Entry& o) const {  // o if take, else this (selects)
    return {take ? o.k : k, take ? o.c1 : c1, take ? o.c2 : c2, take ? o.meta : meta};
  }
};

// Warp 0 of the block: pops up to `budget` (<= kMaxBudget) nodes from log-probabilities lp [L][lds] (fp64, in
// shared memory: no conversion on the pop's chain; the first min(K, budget) of each depth read, all finite)
// into `out` (nodes 1..n), returns n. The loop body is branch-free (selects) but for its warp-uniform exit.
__device__ int build(const double* lp, int lds, int L, int K, int budget, Nodes out) {
  const int lane = threadIdx.x & 31;
  const int KU = K < budget ? K : budget;
  // Shared memory through its shared-window addresses: a generic load (what a pointer compiles to) costs more
  // latency than ld.shared, and both loads sit on the pop's chain.
  const uint32_t lp_s = static_cast<uint32_t>(__cvta_generic_to_shared(lp));
  const uint32_t score_s = static_cast<uint32_t>(__cvta_generic_to_shared(out.score));
  const Entry empty{0, 0, 0, 0};
  // Depth 1, rank 0, parent the root: the whole frontier, in lane 0 and as the first pop's entry.
  const double s0 = lp[0];
  const Entry first{order_key(s0), (14ull << 60) | kLow60, uint32_t(kLow30), 1 << 8 | is_neg_zero(s0) << 18};
  Entry e = lane == 0 ? first : empty, top = first;
  int n = 0;
  while (n < budget && top.k != 0) {  // (top.k == 0: every prefix popped, fewer than `budget`)
    const Entry second = e.shfl(1);  // the next pop's entry unless one pushed below beats it
    const int m = top.meta, p = node_parent(m), d = node_depth(m), r = node_rank(m), node = ++n;
    const double s = key_score(top.k, (m >> 18) & 1);
    // Next sibling: the parent's score plus the next rank's log-probability (depth 1: the log-probability
    // itself, as the reference's first beam). The loads are unconditional (indices clamped into lp): their
    // latency overlaps instead of following a branch. The parent's score: written by this lane (every lane
    // writes each popped score, the same value to the same word), so no warp barrier orders it.
    const bool has_sib = r + 1 < KU, has_child = d < L;
    const double lv = lds_f64(lp_s + 8u * ((d - 1) * lds + min(r + 1, KU - 1)));
    const double base = d == 1 ? -0.0 : lds_f64(score_s + 8u * p);  // -0.0: the additive identity
    const double ss = base + lv, cs = s + lds_f64(lp_s + 8u * (min(d, L - 1) * lds));
    const bool hi = d <= 10;
    // Keys masked, not selected: `has ? order_key(x) : 0` compiled to a branch around the key.
    const Entry sib{order_key(ss) & (0ull - has_sib), hi ? top.c1 - rank_unit(d, true) : top.c1,
                    hi ? top.c2 : top.c2 - uint32_t(rank_unit(d, false)),
                    p | d << 8 | (r + 1) << 12 | is_neg_zero(ss) << 18};
    const Entry child{order_key(cs) & (0ull - has_child), top.c1 - (1ull << 60), top.c2,
                      node | (d + 1) << 8 | is_neg_zero(cs) << 18};
    // Where each pushed entry goes in the list without the popped one (lane j + 1's entry is its j-th): after
    // the entries that beat it, and after the other pushed entry if that one is better. Lane 0 (the popped
    // entry) takes no part; empty lanes beat nothing.
    const unsigned rest = ~1u;
    const bool sib_first = sib > child;  // (an absent child has key 0: the sibling first, and vice versa)
    const int pos_s = __popc(__ballot_sync(~0u, e > sib) & rest) + (has_child && !sib_first);
    const int pos_c = __popc(__ballot_sync(~0u, e > child) & rest) + (has_sib && sib_first);
    top = second.pick(has_child && pos_c == 0, child).pick(has_sib && pos_s == 0, sib);
    // Each lane's new entry: a pushed one, or the old entry as many places on as pushed entries land before
    // it, minus the popped one; beyond lane 31 it falls off the end (see the top of the file).
    const int src = lane + 1 - (has_sib && pos_s < lane) - (has_child && pos_c < lane);
    const Entry moved = e.shfl(min(src, 31)).pick(src > 31, empty);
    e = moved.pick(has_child && lane == pos_c, child).pick(has_sib && lane == pos_s, sib);
    // (After the loads above: the stores' address arithmetic stays off the pop's chain.)
    out.score[node] = s, out.meta[node] = m;
  }
  return n;
}

}  // namespace ddtree_heap
