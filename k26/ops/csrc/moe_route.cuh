// The MoE routing table: the (token, k) pairs grouped by expert, in groups of at most `gt` tokens, as the
// expert GEMMs of csrc/moe_w4a16.cu read it. Built by the router kernel's last block (csrc/moe_router.cu, when
// asked: the model's path for more than one token) or else by the expert op's route_kernel.
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
// P <= 2 x threads, else twice; a functor so that a producer holding the ids in shared memory can pass them from
// there). sm: 3 * E ints of shared memory. Two scans' worth of barriers whatever E: each thread scans a run of
// consecutive experts in registers (the expert op's route_kernel and the router kernel's last block both call it).
template <typename Ids>
__device__ inline void build_route_table(Ids id, int P, int E, int gt, int S, RouteTable tab, int* sm) {
  __shared__ int warp_tot[2][32], warp_pre[2][33];
  const int G = route_groups(P, S, E, gt);
  int* count = sm;            // [E]
  int* cursor = sm + E;       // [E] pair offset of each expert, then a running cursor
  int* gcursor = sm + 2 * E;  // [E] first group of each expert
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthreads = blockDim.x;
  // Up to two pairs per thread (M <= 64 at top-8 on 256 threads): their ids are read once and kept for the
  // scatter at the end, one global round trip instead of two.
  const bool cached = P <= 2 * nthreads;
  int64_t my_id[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) my_id[j] = cached && tid + j * nthreads < P ? id(tid + j * nthreads) : -1;
  for (int e = tid; e < E; e += nthreads) count[e] = 0;
  __syncthreads();
  if (cached) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (my_id[j] >= 0 && my_id[j] < E) atomicAdd(&count[my_id[j]], 1);
  } else {
    for (int p = tid; p < P; p += nthreads) {
      const int64_t e = id(p);
      if (e >= 0 && e < E) atomicAdd(&count[e], 1);
    }
  }
  __syncthreads();
  // Exclusive scans of pair counts and group counts in expert order: thread t owns experts [t ept, t ept + ept).
  const int ept = (E + nthreads - 1) / nthreads, e0 = tid * ept;
  int ic = 0, ig = 0;
  for (int i = 0; i < ept && e0 + i < E; ++i) {
    const int c = count[e0 + i];
    ic += c, ig += (c + gt - 1) / gt;
  }
  const int own_c = ic, own_g = ig;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int vc = __shfl_up_sync(0xffffffffu, ic, o), vg = __shfl_up_sync(0xffffffffu, ig, o);
    if (lane >= o) ic += vc, ig += vg;
  }
  if (lane == 31) warp_tot[0][warp] = ic, warp_tot[1][warp] = ig;
  __syncthreads();
  // Warp 0 scans the warps' totals (one shuffle scan, not a serial sum of up to 32 per thread: ~1 µs of a
  // 1024-thread block's shared-memory loads) into their exclusive prefixes and the totals.
  if (warp == 0) {
    const int nw = nthreads / 32;
    int sc = lane < nw ? warp_tot[0][lane] : 0, sg = lane < nw ? warp_tot[1][lane] : 0;
    const int wc = sc, wg = sg;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int vc = __shfl_up_sync(0xffffffffu, sc, o), vg = __shfl_up_sync(0xffffffffu, sg, o);
      if (lane >= o) sc += vc, sg += vg;
    }
    warp_pre[0][lane] = sc - wc, warp_pre[1][lane] = sg - wg;
    if (lane == 31) warp_pre[0][32] = sc, warp_pre[1][32] = sg;
  }
  __syncthreads();
  {
    int pc = warp_pre[0][warp] + ic - own_c, pg = warp_pre[1][warp] + ig - own_g;
    for (int i = 0; i < ept && e0 + i < E; ++i) {
      const int c = count[e0 + i];
      cursor[e0 + i] = pc, gcursor[e0 + i] = pg;
      pc += c, pg += (c + gt - 1) / gt;
    }
  }
  const int total_groups = warp_pre[1][32];
  // The shared expert (id E) sees every token: slots P + t after all routed pairs, groups 0.. first.
  const int shared_groups = (S + gt - 1) / gt;
  if (tid == 0) *tab.num_groups = min(total_groups + shared_groups, G);
  for (int j = tid; j < shared_groups; j += nthreads) {
    const int gi = j;
    if (gi < G) {
      tab.expert[gi] = E;
      tab.start[gi] = P + j * gt;
      tab.len[gi] = min(gt, S - j * gt);
    }
  }
  for (int t = tid; t < S; t += nthreads) tab.sorted[P + t] = P + t;
  __syncthreads();  // cursor / gcursor written by their owners
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
  if (cached) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (my_id[j] >= 0 && my_id[j] < E) tab.sorted[atomicAdd(&cursor[my_id[j]], 1)] = tid + j * nthreads;
  } else {
    for (int p = tid; p < P; p += nthreads) {
      const int64_t e = id(p);
      if (e >= 0 && e < E) tab.sorted[atomicAdd(&cursor[e], 1)] = p;  // order within an expert is irrelevant
    }
  }
}
