// The MoE routing table: the (token, k) pairs grouped by expert, in groups of at most `gt` tokens, as the
// expert GEMMs of csrc/moe_w4a16.cu read it. Built by the expert op's route_kernel unless the caller passes
// one (a router kernel that wrote it in its last block was tried in run 3: commit 7aecc8d).
//
// One int32 buffer (k26/ops/moe_cuda.py: route_table_size / route_table, the torch reference):
//   [0]                 number of groups (<= G)
//   sorted[P + S]       pair slots by expert (pairs of one expert contiguous, their order unspecified);
//                       shared-expert slots P + t hold P + t
//   expert[G], start[G], len[G]: each group's expert (E = the shared expert), first slot, token count.
// The shared expert's groups come first (group j: slots P + j*gt onwards, known without reading the table,
// so its GEMM blocks can start before the routing finishes), then the routed ones in expert order; ids
// outside [0, E) belong to no group.
//
// Legality: plain loads, stores and shared-memory atomics: sm_90a and sm_120a.

#pragma once

#include <stdint.h>

struct RouteTable {
  int *num_groups, *sorted, *expert, *start, *len;
};

// Upper bound on the groups: one partial group per touched expert, full groups, the shared expert's.
__host__ __device__ inline int route_groups(int P, int S, int E, int gt) {
  return (P < E ? P : E) + P / gt + 1 + (S + gt - 1) / gt;
}

__host__ __device__ inline size_t route_table_ints(int P, int S, int E, int gt) {
  return 1 + (size_t)P + S + 3 * (size_t)route_groups(P, S, E, gt);
}

__host__ __device__ inline RouteTable route_table_at(int* base, int P, int S, int E, int gt) {
  const int G = route_groups(P, S, E, gt);
  int* sorted = base + 1;
  int* expert = sorted + P + S;
  return RouteTable{base, sorted, expert, expert + G, expert + 2 * G};
}

// One block (any multiple of 32 threads up to 1024) builds the table of the P ids `id(p)` gives (read once when
// P <= threads, else twice; a functor so that a producer holding the ids in shared memory can pass them from there).
// sm: 3 * E ints of shared memory.
template <typename Ids>
__device__ inline void build_route_table(Ids id, int P, int E, int gt, int S, RouteTable tab, int* sm) {
  __shared__ int warp_tot[2][32], warp_pre[2][33];
  const int G = route_groups(P, S, E, gt);
  int* count = sm;            // [E]
  int* cursor = sm + E;       // [E] pair offset of each expert, then a running cursor
  int* gcursor = sm + 2 * E;  // [E] first group of each expert
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthreads = blockDim.x;
  // Up to one pair per thread (M <= 64 at top-8 with 512 threads): its id is read once and kept for the
  // scatter at the end, one global round trip instead of two.
  const bool cached = P <= nthreads;
  const int64_t my_id = cached && tid < P ? id(tid) : -1;
  for (int e = tid; e < E; e += nthreads) count[e] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += nthreads) {
    const int64_t e = cached ? my_id : id(p);
    if (e >= 0 && e < E) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // Exclusive scans of pair counts and group counts, in chunks of blockDim experts.
  int base_pairs = 0, base_groups = 0;
  for (int e0 = 0; e0 < E; e0 += nthreads) {
    const int e = e0 + tid;
    const int c = e < E ? count[e] : 0;
    const int g = (c + gt - 1) / gt;
    int ic = c, ig = g;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int vc = __shfl_up_sync(0xffffffffu, ic, o), vg = __shfl_up_sync(0xffffffffu, ig, o);
      if (lane >= o) ic += vc, ig += vg;
    }
    if (lane == 31) warp_tot[0][warp] = ic, warp_tot[1][warp] = ig;
    __syncthreads();
    // Warp 0 scans the warps' totals (one shuffle scan, not a serial sum of up to 32 per thread: ~1 µs of a
    // 1024-thread block's shared-memory loads) into their exclusive prefixes and the chunk's totals.
    if (warp == 0) {
      const int nw = nthreads / 32;
      int sc = lane < nw ? warp_tot[0][lane] : 0, sg = lane < nw ? warp_tot[1][lane] : 0;
      const int own_c = sc, own_g = sg;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int vc = __shfl_up_sync(0xffffffffu, sc, o), vg = __shfl_up_sync(0xffffffffu, sg, o);
        if (lane >= o) sc += vc, sg += vg;
      }
      warp_pre[0][lane] = sc - own_c, warp_pre[1][lane] = sg - own_g;
      if (lane == 31) warp_pre[0][32] = sc, warp_pre[1][32] = sg;
    }
    __syncthreads();
    const int wc = warp_pre[0][warp], wg = warp_pre[1][warp], tc = warp_pre[0][32], tg = warp_pre[1][32];
    if (e < E) {
      cursor[e] = base_pairs + wc + ic - c;
      gcursor[e] = base_groups + wg + ig - g;
    }
    base_pairs += tc, base_groups += tg;
    __syncthreads();
  }
  // The shared expert (id E) sees every token: slots P + t after all routed pairs, groups 0.. first.
  const int shared_groups = (S + gt - 1) / gt;
  if (tid == 0) *tab.num_groups = min(base_groups + shared_groups, G);
  for (int j = tid; j < shared_groups; j += nthreads) {
    const int gi = j;
    if (gi < G) {
      tab.expert[gi] = E;
      tab.start[gi] = P + j * gt;
      tab.len[gi] = min(gt, S - j * gt);
    }
  }
  for (int t = tid; t < S; t += nthreads) tab.sorted[P + t] = P + t;
  for (int e = tid; e < E; e += nthreads) {
    const int c = count[e];
    for (int j = 0; j * gt < c; ++j) {
      const int gi = shared_groups + gcursor[e] + j;
      if (gi < G) {
        tab.expert[gi] = e;
        tab.start[gi] = cursor[e] + j * gt;
        tab.len[gi] = min(gt, c - j * gt);
      }
    }
  }
  __syncthreads();
  for (int p = tid; p < P; p += nthreads) {
    const int64_t e = cached ? my_id : id(p);
    if (e >= 0 && e < E) tab.sorted[atomicAdd(&cursor[e], 1)] = p;  // order within an expert is irrelevant
  }
}
