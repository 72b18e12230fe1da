// DDTree construction on the device: one thread block per tree, the same level-by-level algorithm and
// the same total order as k26/spec/tree.py (score desc, depth asc, rank tuple asc), in fp64 scores.
//
//   beam_1 = the top-W depth-1 prefixes (the top-K tokens, already sorted by the caller's topk)
//   beam_d = top-W of the admissible children (i, j), (i+1)(j+1) <= budget, of beam_{d-1}: sorted in
//            shared memory on (score desc, lexicographic key asc), a rank sort when there are at most two
//            candidates per thread, else a bitonic network
//   nodes  = the top `budget` of the union of beams: each element's global rank is found by binary
//            search in every depth's score-sorted beam; parents, tokens, depths and the ancestor
//            bitmask words (what the tree attention reads) are written in pop order.
//
// Small trees (beams + candidates <= 64 KB: budget <= 128 at depth 15) keep the beams in shared memory, large
// ones in the caller's global scratch; the ancestor words walk the parents in shared memory.
// Budgets <= 64 with finite log-probabilities take one warp's best-first heap instead (csrc/ddtree_heap.cuh:
// budget pops whatever the depth, integer keys): H100, graph-replayed op (2026-12-06-moe-groups-tree-heap-
// session30-h100.md), depth 15 budget 16 / 32 / 64: 48.0 / 66.9 / 129.3 -> 14.5 / 22.4 / 40.3 µs, depth 7 25.8 /
// 33.6 / 56.6 -> 14.4 / 22.5 / 40.2; in the DDTree budget-15 step's kernel table 20 -> 11 µs. Since session 32
// the frontier a sorted list across the warp: 6.4 / 10.1 / 18.0 µs at depth 15, 20 builds back to back (the
// header of csrc/ddtree_heap.cuh). Nodes with a non-finite score are invalid, parent 0, seeing only themselves,
// as the reference's.
//
// Legality: plain CUDA (warp shuffles, ballot), no tensor cores; at most 64 KB + a few KB of
// dynamic shared memory (budget 512):
// legal on sm_120 (99 KB) and sm_90; built for sm_90a and sm_120a. Benchmark: profiling/bench_tree.py; H200,
// depth 7 (2026-12-02-bench_tree-h200.md): budget 16 46.7 -> 23.5 µs a graph-replayed op, 64 103 -> 54, 512
// 860 -> 750; in the DDTree budget-15 step the kernel 46 -> 20 µs.

#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "ddtree_heap.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int THREADS = 512;
constexpr int MAX_BUDGET = 512;

struct Scratch {  // per tree, [L][budget] each: in shared memory for small trees, else global (L2-resident)
  double* score;   // beam in score order
  int* lexpos;     // lexicographic position of the element within its beam
  int* parent;     // score-rank of the parent in the previous beam (-1 at depth 1)
  int* j;          // token rank at this depth
  int* grank;      // global pop-order rank (or >= budget if not selected)
};

__device__ __forceinline__ bool before(double sa, int la, double sb, int lb) {  // (score desc, lex asc)
  return sa > sb || (sa == sb && la < lb);
}

// Bitonic sort of n2 (power of two) (score, lex, payload) triples in shared memory, ascending in `before`.
__device__ void bitonic(double* s, int* lx, int* pl, int n2) {
  for (int k = 2; k <= n2; k <<= 1) {
    for (int jj = k >> 1; jj > 0; jj >>= 1) {
      for (int i = threadIdx.x; i < n2; i += blockDim.x) {
        const int p = i ^ jj;
        if (p > i) {
          const bool up = (i & k) == 0;
          const bool swap = up ? before(s[p], lx[p], s[i], lx[i]) : before(s[i], lx[i], s[p], lx[p]);
          if (swap) {
            const double ts = s[i]; s[i] = s[p]; s[p] = ts;
            const int tl = lx[i]; lx[i] = lx[p]; lx[p] = tl;
            const int tp = pl[i]; pl[i] = pl[p]; pl[p] = tp;
          }
        }
      }
      __syncthreads();
    }
  }
}

// `spar` of a node whose score is not finite (-inf log-probabilities): invalid, its parent 0, its words itself
// only, as the reference's (valid = isfinite(score)); such a node comes after every finite one in pop order.
constexpr int kInvalidNode = -2;

// One tree's outputs (the op's [B, 1 + budget(, NW)] tensors at this block's tree).
struct Out {
  int64_t *tok, *par, *dep, *words;
  bool* valid;
  double* score;
};

// Every node's defaults (padding nodes: token 0, depth 1, score -inf, the root's parent -1), `spar` to match;
// nodes 1..n are valid. The caller writes its nodes over them after a barrier.
__device__ void write_defaults(const Out& o, int* spar, int N, int n) {
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    o.tok[i] = 0, o.dep[i] = i == 0 ? 0 : 1, o.score[i] = i == 0 ? 0.0 : -CUDART_INF;
    o.valid[i] = i <= n;
    spar[i] = i == 0 ? -1 : 0;
  }
}

// The parents and the ancestor-or-self words from `spar` (after the nodes are written and a barrier); nodes
// past n and kInvalidNode ones see only themselves.
// Ancestor words by walking the parents in shared memory (from global memory each step of the walk was a
// dependent L2 round trip: up to L of them), gathered in a register and stored once, highest word first. A
// parent precedes its child in pop order, so the walk visits falling word indices; a parent that does not
// (log-probs > 0 or NaN: outside the op's contract) ends the walk instead of reading past `spar`.
__device__ void write_words(const Out& o, const int* spar, int N, int NW, int n, int L) {
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    const bool self_only = i > n || spar[i] == kInvalidNode;
    o.par[i] = spar[i] == kInvalidNode ? 0 : spar[i];
    int64_t* row = o.words + (size_t)i * NW;
    for (int w = NW - 1; w > i / 64; --w) row[w] = 0;
    int cw = i / 64, u = i;
    uint64_t cur = 0;
    for (int step = 0; step <= L && u >= 0; ++step) {
      for (; u / 64 < cw; --cw) row[cw] = (int64_t)cur, cur = 0;
      cur |= 1ull << (u % 64);
      const int up = spar[u];
      u = self_only || up >= u ? -1 : up;  // a padding or invalid node is its own only ancestor
    }
    for (; cw >= 0; --cw) row[cw] = (int64_t)cur, cur = 0;
  }
}

// Budgets <= ddtree_heap::kMaxBudget with finite log-probabilities (lp [L][lds] in shared memory): warp 0's
// best-first search (csrc/ddtree_heap.cuh) over the log-probabilities widened to fp64 first (the pop's chain
// then loads its addends as they are summed), then the block writes the outputs.
__device__ void heap_tree(const float* lp, int lds, const int64_t* tokb, int L, int K, int budget, const Out& o,
                          int* spar) {
  constexpr int NB = ddtree_heap::kMaxBudget + 1;
  __shared__ double nscore[NB], lpd[15 * ddtree_heap::kMaxBudget];
  __shared__ int nmeta[NB], s_n;
  const int KU = min(K, budget);
  for (int i = threadIdx.x; i < L * KU; i += blockDim.x) lpd[i] = static_cast<double>(lp[(i / KU) * lds + i % KU]);
  __syncthreads();
  if (threadIdx.x < 32) {
    const int n = ddtree_heap::build(lpd, KU, L, K, budget, ddtree_heap::Nodes{nscore, nmeta});
    if (threadIdx.x == 0) s_n = n;
  }
  __syncthreads();
  const int n = s_n, N = 1 + budget;
  write_defaults(o, spar, N, n);
  __syncthreads();
  for (int i = 1 + threadIdx.x; i <= n; i += blockDim.x) {
    const int m = nmeta[i], d = ddtree_heap::node_depth(m);
    o.tok[i] = tokb[(size_t)(d - 1) * K + ddtree_heap::node_rank(m)];
    o.dep[i] = d;
    o.score[i] = nscore[i];
    spar[i] = ddtree_heap::node_parent(m);
  }
  __syncthreads();
  write_words(o, spar, N, (N + 63) / 64, n, L);
}

// Admissible children of the parent of score-rank i: j < min(K, budget / (i + 1)).
__host__ __device__ __forceinline__ int children(int i, int K, int budget) {
  return K < budget / (i + 1) ? K : budget / (i + 1);
}

// scratch_smem: byte offset of the beams in dynamic shared memory, or -1 for the global scratch (large trees);
// lp_smem: of the tree's usable log-probabilities (L x min(K, budget) floats, copied in first), or -1.
// (Launch bounds with one block an SM: with the thread count alone ptxas for sm_120a (1,536 threads an SM) aimed
// at three blocks, 40 registers, and spilled; one block a sequence runs anyway.)
__global__ void __launch_bounds__(THREADS, 1) build_kernel(
    const float* __restrict__ lp, const int64_t* __restrict__ tok, int L, int K, int budget, int64_t* __restrict__ out_tok,
    int64_t* __restrict__ out_par, int64_t* __restrict__ out_dep, bool* __restrict__ out_valid,
    int64_t* __restrict__ out_words, double* __restrict__ out_score, char* __restrict__ scratch_base,
    int scratch_smem, int lp_smem, int heap_ok) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
  const int N = 1 + budget, NW = (N + 63) / 64;
  const size_t per = (size_t)L * budget;
  // Small trees keep their beams in shared memory: every depth reads the previous one, and from global memory
  // each such read was a dependent L2 round trip.
  char* sb = scratch_smem >= 0 ? reinterpret_cast<char*>(smem) + scratch_smem : scratch_base + (size_t)b * per * 24;
  Scratch sc{reinterpret_cast<double*>(sb), reinterpret_cast<int*>(sb + per * 8), reinterpret_cast<int*>(sb + per * 12),
             reinterpret_cast<int*>(sb + per * 16), reinterpret_cast<int*>(sb + per * 20)};
  const float* lpb = lp + (size_t)b * L * K;
  const int64_t* tokb = tok + (size_t)b * L * K;
  __shared__ int width[16];  // beam size per depth (L <= 15)
  __shared__ int cstart[MAX_BUDGET + 1];
  __shared__ int spar[MAX_BUDGET + 1];  // each node's parent, for the ancestor words
  // The log-probabilities a candidate can read (j < min(K, budget)) in one round trip for every depth, not one
  // dependent global read per depth.
  const int KU = children(0, K, budget);  // min(K, budget)
  int lds = K;
  if (lp_smem >= 0) {
    float* dst = reinterpret_cast<float*>(smem + lp_smem);
    for (int i = tid; i < L * KU; i += blockDim.x) dst[i] = lpb[(size_t)(i / KU) * K + i % KU];
    lpb = dst, lds = KU;
    __syncthreads();
  }
  const Out o{out_tok + (size_t)b * N, out_par + (size_t)b * N, out_dep + (size_t)b * N,
              out_words + (size_t)b * N * NW, out_valid + (size_t)b * N, out_score + (size_t)b * N};
  if (heap_ok) {  // budget <= 64, lp staged above: the heap unless a log-probability is not finite
    bool bad = false;
    for (int i = tid; i < L * KU; i += blockDim.x) bad |= !isfinite(lpb[i]);
    if (!__syncthreads_or(bad)) {
      heap_tree(lpb, lds, tokb, L, K, budget, o, spar);
      return;
    }
  }

  // Depth 1: the top-K tokens in rank order are already score order and lexicographic order.
  const int W0 = min(budget, K);
  for (int k = tid; k < W0; k += blockDim.x) {
    sc.score[k] = (double)lpb[k], sc.lexpos[k] = k, sc.parent[k] = -1, sc.j[k] = k;
  }
  if (tid == 0) width[0] = W0;
  __syncthreads();

  double* cs = reinterpret_cast<double*>(smem);  // candidate arrays, n2 <= 4096
  for (int d = 1; d < L; ++d) {
    const int Wp = width[d - 1];
    const double* ps = sc.score + (size_t)(d - 1) * budget;
    const int* plex = sc.lexpos + (size_t)(d - 1) * budget;
    // Exclusive prefix sums of the admissible children per parent: warp 0, 32 parents a shuffle scan (a serial
    // loop of Wp integer divisions in one thread was ~1 µs a depth at budget 64).
    if (tid < 32) {
      int carry = 0;
      for (int i0 = 0; i0 < Wp; i0 += 32) {
        const int i = i0 + lane, c = i < Wp ? children(i, K, budget) : 0;
        int inc = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, inc, o);
          if (lane >= o) inc += v;
        }
        if (i < Wp) cstart[i] = carry + inc - c;
        carry += __shfl_sync(0xffffffffu, inc, 31);
      }
      if (lane == 0) cstart[Wp] = carry;
    }
    __syncthreads();
    const int P = cstart[Wp];
    int n2 = 1;
    while (n2 < P) n2 <<= 1;
    int* clex = reinterpret_cast<int*>(cs + n2);
    int* cpl = clex + n2;
    for (int c = tid; c < n2; c += blockDim.x) {
      if (c < P) {
        int lo = 0, hi = Wp;  // parent i: cstart[i] <= c < cstart[i + 1]
        while (hi - lo > 1) {
          const int mid = (lo + hi) >> 1;
          if (cstart[mid] <= c) lo = mid; else hi = mid;
        }
        const int jj = c - cstart[lo];
        cs[c] = ps[lo] + (double)lpb[(size_t)d * lds + jj];
        clex[c] = plex[lo] * K + jj;
        cpl[c] = c;
      } else {
        cs[c] = -CUDART_INF, clex[c] = 0x7fffffff, cpl[c] = -1;
      }
    }
    __syncthreads();
    if (P <= 2 * (int)blockDim.x) {
      // Rank sort: each candidate counts the ones before it (keys are distinct: a permutation), then all move
      // at once — two barriers where the bitonic network takes log2(n2)(log2(n2) + 1) / 2 (21 at budget 16).
      double vs[2];
      int vl[2], vr[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int c = tid + u * blockDim.x;
        vr[u] = -1;
        if (c < P) {
          vs[u] = cs[c], vl[u] = clex[c];
          int r = 0;
          for (int q = 0; q < P; ++q) r += before(cs[q], clex[q], vs[u], vl[u]);
          vr[u] = r;
        }
      }
      __syncthreads();
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (vr[u] >= 0) cs[vr[u]] = vs[u], clex[vr[u]] = vl[u], cpl[vr[u]] = tid + u * blockDim.x;
      __syncthreads();
    } else {
      bitonic(cs, clex, cpl, n2);
    }
    const int W = min(budget, P);
    double* ns = sc.score + (size_t)d * budget;
    int* nlex = sc.lexpos + (size_t)d * budget;
    for (int k = tid; k < W; k += blockDim.x) {
      const int c = cpl[k];
      int lo = 0, hi = Wp;
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (cstart[mid] <= c) lo = mid; else hi = mid;
      }
      ns[k] = cs[k], sc.parent[(size_t)d * budget + k] = lo, sc.j[(size_t)d * budget + k] = c - cstart[lo];
      int pos = 0;  // lexicographic position among the W selected (keys are distinct)
      for (int q = 0; q < W; ++q) pos += clex[q] < clex[k];
      nlex[k] = pos;
    }
    if (tid == 0) width[d] = W;
    __syncthreads();
  }

  // Global pop order over the union: rank = elements of every depth that come first.
  double* us = reinterpret_cast<double*>(smem);  // all beam scores, [L][budget]
  for (int i = tid; i < L * budget; i += blockDim.x) {
    const int d = i / budget, k = i % budget;
    us[i] = k < width[d] ? sc.score[i] : -CUDART_INF;
  }
  __syncthreads();
  for (int i = tid; i < L * budget; i += blockDim.x) {
    const int d = i / budget, k = i % budget;
    if (k >= width[d]) { sc.grank[i] = 0x7fffffff; continue; }
    const double s = us[i];
    int r = k;  // same depth: its score rank
    for (int e = 0; e < L; ++e) {
      if (e == d) continue;
      // depth e elements before (s, d): score > s, or score == s and e < d (shallower first)
      const double* a = us + (size_t)e * budget;
      int lo = 0, hi = width[e];
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (a[mid] > s || (e < d && a[mid] == s)) lo = mid + 1; else hi = mid;
      }
      r += lo;
    }
    sc.grank[i] = r;
  }
  __syncthreads();
  int total = 0;
  for (int d = 0; d < L; ++d) total += width[d];
  const int n = min(budget, total);
  write_defaults(o, spar, N, n);
  __syncthreads();
  for (int i = tid; i < L * budget; i += blockDim.x) {
    const int d = i / budget;
    const int r = sc.grank[i];
    if (r >= n) continue;
    const int node = r + 1;
    o.tok[node] = tokb[(size_t)d * K + sc.j[i]];
    o.dep[node] = d + 1;
    o.score[node] = us[i];
    spar[node] = d == 0 ? 0 : sc.grank[(size_t)(d - 1) * budget + sc.parent[i]] + 1;
    if (!isfinite(us[i])) o.valid[node] = false, spar[node] = kInvalidNode;
  }
  __syncthreads();
  write_words(o, spar, N, NW, n, L);
}

}  // namespace

K26_EXPORT size_t k26_ddtree_scratch(int B, int L, int budget) { return (size_t)B * L * budget * 24; }

// The shared-memory opt-in above 48 KB, for the current device: the front door's plan calls it once per
// device before the first launch (an attribute set on one device's context does not carry to another's).
constexpr int kMaxSmem = 16 * 4096;  // the opt-in: 64 KB (sm_120 allows 99 KB a block)

K26_EXPORT int k26_ddtree_prepare() {
  return (int)cudaFuncSetAttribute(build_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
}

K26_EXPORT int k26_ddtree_build(const float* lp, const int64_t* tok, int B, int L, int K, int budget, int64_t* out_tok,
                                int64_t* out_par, int64_t* out_dep, bool* out_valid, int64_t* out_words,
                                double* out_score, void* scratch, void* stream) {
  if (budget > MAX_BUDGET || budget < 1 || K < 1 || L > 15 || L < 1) return (int)cudaErrorInvalidValue;
  // Candidates of one depth: at most sum_i min(K, budget / (i + 1)) (< budget * H(budget) < 4096 for budget
  // <= 512), sorted in a power of two; 16 bytes each. The union of the beams' scores reuses that region.
  size_t most = 0;
  for (int i = 0; i < budget; ++i) most += (size_t)children(i, K, budget);
  size_t n2 = 1;
  while (n2 < most) n2 <<= 1;
  const size_t cand = 16 * n2, uni = (size_t)8 * L * budget, beams = (size_t)24 * L * budget;
  const size_t region = ((cand > uni ? cand : uni) + 15) / 16 * 16;
  const size_t lps = ((size_t)4 * L * children(0, K, budget) + 15) / 16 * 16;  // j < min(K, budget)
  const bool in_smem = region + beams <= kMaxSmem, lp_in_smem = in_smem && region + beams + lps <= kMaxSmem;
  const size_t smem = region + (in_smem ? beams : 0) + (lp_in_smem ? lps : 0);
  build_kernel<<<B, THREADS, smem, static_cast<cudaStream_t>(stream)>>>(
      lp, tok, L, K, budget, out_tok, out_par, out_dep, out_valid, out_words, out_score, static_cast<char*>(scratch),
      in_smem ? (int)region : -1, lp_in_smem ? (int)(region + beams) : -1,
      lp_in_smem && budget <= ddtree_heap::kMaxBudget);
  return (int)cudaGetLastError();
}
