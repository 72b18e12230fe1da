// Fused MoE router for Kimi K2.6 (noaux_tc): one launch from the normed hidden state to the routing
// the expert kernel takes (top-k ids int64 [M, K] and weights fp32 [M, K]).
//
//   logits = x · Wᵀ (bf16 weight read as stored, bf16 products exact, fp32 accumulation)
//   score  = sigmoid(logits);  choice = score + correction_bias          (bias selects, score weights)
//   groups (n_group > 1): keep the topk_group groups with the largest sum of their two best choices
//   ids    = top-k of choice over kept groups (descending; an exact tie goes to one of them, deterministically)
//   w      = score[ids] / (Σ score[ids] + 1e-20) (if renormalize) · routed_scaling_factor
//
// One launch, two phases separated by a grid barrier (one token: no barrier, the last block to finish phase 1
// runs phase 2):
//   1. logits: work items (64-token tile, 16-row tile of W, k range); the 8 warps of a block split the
//      item's k range, mma.sync.m16n8k16 with W rows as the A operand ("swap AB": 16 experts x 8
//      tokens per mma, so M = 1 wastes no weight bytes) and reduce in shared memory in warp order;
//      each item writes one fp32 partial per (k range, token, expert). A few k ranges per row tile
//      give the grid enough blocks to stream the 5.5 MB weight at bandwidth.
//   2. per token (one block each): partials summed in k-range order (deterministic), sigmoid, bias (loaded
//      before phase 1); top-k (<= 8) by redux.sync picks over register-held keys, per warp then across the
//      warps' candidates (topk_fast); larger topk by one warp's serial picks (topk_serial).
//   3. (when asked, `table`) the expert op's routing table (csrc/moe_route.cuh) from every token's ids, built by
//      the last phase-2 block to finish: the expert op then runs no routing launch of its own.
// PDL: the first weight batch is loaded before the grid-dependency wait; dependents may launch right after
// it (the expert op's shared-expert blocks overlap this kernel; they read x, complete by then).
// The k index inside each 64-wide chunk is permuted identically for A and B (lane t owns k in
// [16t, 16t + 16)), so each lane's fragments are 32 contiguous bytes of a W row / an x row: plain
// 16-byte loads, no ldmatrix, no shared-memory staging.
// The barrier needs every block resident: the grid is capped at SMs x occupancy (queried); its two
// int32 counters (arrivals, departures) and the phase-2 arrival count start at zero and every launch leaves
// them at zero.
//
// Legality: warp-level mma.sync bf16 only, <= 48 KB static shared memory per block: legal on sm_120
// (99 KB) and sm_90; built for sm_90a and sm_120a. No host sync: CUDA-graph capturable.
// Speed and its benchmark: profiling/bench_moe.py --block (router column and whole block), results in
// profiling/results/2026-12-01-bench_moe_block-h200*.md (H200, K2.6 shapes, cold L2, graph replay): 6.9 µs
// at M = 1, 8.1 at M = 16, 9.9 at M = 64 (runs 6-7); 6.3 at M = 1 with phase 2's partials in one round trip
// (2026-12-01-bench_moe_block-h200-one-launch.md). Phases at M = 1 (profiling/debug/router_trace.py): weight
// tile in and multiplied 3.1 µs from the first block's start, partials written 3.3, last block in 4.6,
// scores 6.4, top-k written 8.5 (the trace's stamps cost ~1 µs). Before run 6: 11.8 µs (bias loaded after
// the barrier, one L2 round trip per expert's partials, one warp's serial top-k: 3.1 and 2.8 µs). Tried and
// dropped: merging sorted 64-bit key lists in a shuffle butterfly (1.5 µs in its five rounds alone); a
// generation-counting barrier (no gain); no barrier, the last block of each token tile selecting its tokens
// and writing the expert op's routing table (run 3, commit 7aecc8d: 28.5 / 53.3 µs at M = 16 / 64).
// Phase 3 (the table by the last phase-2 block): the M = 16 block 104.9 -> 104.5 µs, one launch fewer; the
// verify N = 16 step 7.25 -> 7.23 ms (2026-12-02-bench_moe-router-table-h200.md).
// Also dropped (2026-12-05-moe-two-launch-session25-h100.md, H100): at one token, every block L2-prefetching the
// chosen experts' gate/up weights once the ids are written (the early blocks waiting on a flag): the MoE block
// 25.2 -> 28.5 µs. router_kernel<1, GateUpArgs> (the gate/up in this grid: csrc/moe_router_gate_up.cuh) is kept
// as the opt-in `moe_one_token`: two launches, but 25.2 -> 25.8 µs and the decode step 4.48 -> 4.76 ms. And no
// early release of the expert op (its gate/up blocks spread over an idle GPU instead of where the router leaves
// room): the block at one token 25.2 -> 25.9 µs, the decode / verify N = 16 steps 4.48 / 7.38 -> 4.55 / 7.54 ms.
// And (2026-12-07-router-l2-ahead-session44-h100.md, H100): the blocks done after phase 1 bulk-prefetching into L2
// the first third of the next layer's q_a / kv_a rows (10 of 30 MB): the projection gained ~1 µs a layer, the
// expert op's first loads lost more — decode 4.21 -> 4.23 ms, verify N = 16 7.11 -> 7.18 (code in 0a43a0f).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "globaltimer.cuh"
#include "moe_gate_up_one_token.cuh"  // gated_one_token, shared_acc: the one-token gate/up kernel's items
#include "moe_route.cuh"
#include "pdl.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

// Phase timestamps for profiling/debug/router_trace.py (built with -DK26_ROUTER_TRACE; absent otherwise).
#ifdef K26_ROUTER_TRACE
__device__ unsigned long long g_router_trace[1024][16];
#define TRACE(k) \
  if (threadIdx.x == 0 && blockIdx.x < 1024) g_router_trace[blockIdx.x][k] = k26_globaltimer();
#else
#define TRACE(k)
#endif

#include "moe_router_select.cuh"  // phase 2's selection and the block shape (inside its own namespace)

namespace {

using namespace router_select;

#include "moe_router_logits.cuh"  // Args and phase 1: the logits as fp32 partials

// All blocks are resident (grid capped by occupancy), so spinning cannot starve a block that has not
// started. Arrivals count up to gridDim; departures let the last block re-arm both counters to zero.
__device__ void grid_barrier(int* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&bar[0], 1);
    while (*reinterpret_cast<volatile int*>(&bar[0]) < (int)gridDim.x) __nanosleep(20);
    __threadfence();
    if (atomicAdd(&bar[1], 1) == (int)gridDim.x - 1) {
      atomicExch(&bar[0], 0);
      atomicExch(&bar[1], 0);
    }
  }
  __syncthreads();
}

// The last of `n` blocks to arrive returns true (the others false): one token's phase 2 after the partials
// (no barrier: the others leave at once), the routing table after every token's top-k. The count starts and
// ends at zero like the barrier's.
__device__ bool last_arrival(int* count, int n) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's writes are visible before the count says so
    const int last = atomicAdd(count, 1) == n - 1;
    if (last) {
      atomicExch(count, 0);
      __threadfence();  // acquire: the other blocks' writes are read after their counts
    }
    s_last = last;
  }
  __syncthreads();
  return s_last;
}

#include "moe_router_gate_up.cuh"  // GateUpArgs: router_kernel<1, GateUpArgs>, the one-token block's first launch

constexpr int kKsBatch = 8;  // phase 2's partial loads in flight per expert (plan: ks <= D / 1024, 7 at K2.6)

// A = GateUpArgs (one token only): the router, then the gate/up items of csrc/moe_router_gate_up.cuh.
template <int NT, typename A = Args>
__global__ void __launch_bounds__(kThreads, 2) router_kernel(A a) {
  constexpr bool GU = !std::is_same<A, Args>::value;
  static_assert(!GU || NT == 1, "the gate/up items follow a one-token router");
  __shared__ float red[kWarps][NT * 4][32];
  __shared__ float choice[kMaxE], score[kMaxE];
  __shared__ uint32_t cand_key[kWarps * kFastTopk];
  __shared__ int cand_id[kWarps * kFastTopk];
  TRACE(0);
  // Dependents (the expert op) may launch once every block has passed its grid-dependency wait (in dot_tile,
  // or below for a warp without k chunks): its shared-expert blocks then stream their weights under this
  // kernel and read x before their own wait, which is safe only because x's producer, the kernel before us,
  // has completed by then. (Released at this kernel's start, as until 2026-12-01, a fused all-reduce + norm
  // that releases its dependents early could still be writing x.) Safe for the grid barrier: the dependent
  // grid launches only once every block of this one has triggered, i.e. is resident.
  // The correction bias (a constant) of this thread's experts, for the token blocks of phase 2: loads issued
  // now land during phase 1 (loaded after the barrier they cost a DRAM round trip, ~1 µs cold).
  float bias[kMaxE / kThreads];
#pragma unroll
  for (int j = 0; j < kMaxE / kThreads; ++j) {
    const int e = threadIdx.x + j * kThreads;
    bias[j] = (a.M == 1 || blockIdx.x < a.M) && e < a.E ? __ldg(a.bias + e) : 0.f;
  }
  logits_phase<NT, !GU>(a, red);
  TRACE(2);
  pdl_wait();  // every thread, before any write (a warp without k chunks never waited in dot_tile)
  if constexpr (!GU) pdl_trigger();  // (GU: once the ids are known, gate_up_items)
  const int first = a.M == 1 ? 0 : blockIdx.x;  // this block's first token in phase 2
  if (a.M == 1) {
    if (!last_arrival(a.barrier, gridDim.x)) {
      if constexpr (GU) gate_up_items(a, red);
      return;
    }
  } else {
    grid_barrier(a.barrier);
  }
  TRACE(3);
  for (int tok = first; tok < a.M; tok += gridDim.x) {
    // Every partial of this thread's experts in flight at once: kKsBatch k ranges of every expert loaded before
    // any is added (K2.6, ks <= 7: one L2 round trip; unrolled by 4 it took two); each logit still sums its
    // k ranges in k order (deterministic).
    float l[kMaxE / kThreads];
#pragma unroll
    for (int j = 0; j < kMaxE / kThreads; ++j) l[j] = 0.f;
    for (int k0 = 0; k0 < a.ks; k0 += kKsBatch) {
      float v[kKsBatch][kMaxE / kThreads];
#pragma unroll
      for (int k = 0; k < kKsBatch; ++k)
#pragma unroll
        for (int j = 0; j < kMaxE / kThreads; ++j) {
          const int e = threadIdx.x + j * kThreads;
          v[k][j] = k0 + k < a.ks && e < a.E ? __ldcg(a.partial + ((size_t)(k0 + k) * a.M + tok) * a.E + e) : 0.f;
        }
#pragma unroll
      for (int k = 0; k < kKsBatch; ++k)
#pragma unroll
        for (int j = 0; j < kMaxE / kThreads; ++j)
          if (k0 + k < a.ks) l[j] += v[k][j];  // k order, as before: the same sums
    }
#pragma unroll
    for (int j = 0; j < kMaxE / kThreads; ++j) {
      const int e = threadIdx.x + j * kThreads;
      if (e >= a.E) continue;
      const float s = 1.f / (1.f + expf(-l[j]));
      score[e] = s;
      // A NaN logit (a poisoned or padded row) must still give valid expert ids: it ranks below -inf, and
      // NaN itself stays the "taken" mark of topk_serial (an all-NaN row returned id -1 and read score[-1]).
      const float c = s + (tok == first ? bias[j] : __ldg(a.bias + e));  // later tokens: M > grid
      choice[e] = isnan(c) ? -INFINITY : c;
    }
    __syncthreads();
    TRACE(4);
    const Selection sel{a.out_w, a.out_ids, a.E, a.n_group, a.topk_group, a.topk, a.renormalize, a.scale};
    if (a.n_group > 1) {
      if (threadIdx.x < 32) group_mask(sel, choice);
      __syncthreads();
    }
    if (a.topk <= kFastTopk) topk_fast(sel, choice, score, tok, cand_key, cand_id);
    else if (threadIdx.x < 32) topk_serial(sel, choice, score, tok);
    __syncthreads();
    TRACE(5);
  }
  if constexpr (GU) {  // one token: the ids are written (select's closing barrier)
    raise_ids_flag(a.barrier);
    gate_up_items(a, red);
    return;
  }
  if (a.table == nullptr || first >= a.M) return;
  // The routing table from every token's ids, by the last phase-2 block to finish (one token: the one block
  // that ran phase 2), so the expert op needs no routing launch of its own: the launch and its two grid
  // hand-offs cost ~4 µs of the M = 16 block's critical path (2026-12-01-bench_moe-session11-h200.md).
  if (a.M > 1 && !last_arrival(a.barrier + 2, min(a.M, (int)gridDim.x))) return;
  __shared__ int route_sm[3 * kMaxE];
  const int P = a.M * a.topk;
  build_route_table([&](int p) { return __ldcg(a.out_ids + p); }, P, a.E, a.table_gt, a.table_S,
                    route_table_at(a.table, P, a.table_S, a.E, a.table_gt), route_sm);
  TRACE(11);
}

// The grid that is all resident at once for `Kernel` (its barrier, or a block that polls, needs every block
// running): SMs x occupancy, queried once per device (a host call per launch before; graph capture launches
// once, but eager steps launch every time).
template <auto Kernel>
int resident_grid() {
  static int cached[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 64 || cached[dev] == 0) {
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0);
    const int grid = sms * (per_sm > 0 ? per_sm : 1);
    if (dev >= 64) return grid;
    cached[dev] = grid;
  }
  return cached[dev];
}

#ifdef K26_ROUTER_POLL
#include "moe_router_poll.cuh"  // the one-token variant without the arrival count
#endif

struct Plan {
  int nt, ks, chunks_per_ks, grid;
};

// Token tile from M; enough k ranges that ~2 blocks per SM stream W, never more than the resident grid.
Plan plan(int M, int D, int E) {
  Plan p;
  p.nt = M <= 8 ? 1 : M <= 16 ? 2 : 4;  // more tokens: more token tiles (NT 8 would hold 1 block per SM)
  const int limit = p.nt == 1   ? resident_grid<router_kernel<1>>()
                    : p.nt == 2 ? resident_grid<router_kernel<2>>()
                                : resident_grid<router_kernel<4>>();
  const int kc = D / 64, row_tiles = (E + 15) / 16, m_tiles = (M + 8 * p.nt - 1) / (8 * p.nt);
  // k ranges: as many as fit one resident wave, at most one per two chunks per warp (fewer partials to sum).
  const int cap = kc / (2 * kWarps) > 0 ? kc / (2 * kWarps) : 1;
  int ks = limit / (row_tiles * m_tiles);
  ks = ks < 1 ? 1 : ks > cap ? cap : ks;
  p.chunks_per_ks = (kc + ks - 1) / ks;
  p.ks = (kc + p.chunks_per_ks - 1) / p.chunks_per_ks;
  const int items = row_tiles * m_tiles * p.ks;
  p.grid = items < limit ? items : limit;
  if (p.grid < M && M <= limit) p.grid = M;  // phase 2 runs one token per block
  return p;
}

}  // namespace

#ifdef K26_ROUTER_TRACE
K26_TRACE_EXPORTS(k26_moe_router_trace, k26_moe_router_trace_reset, g_router_trace)
#endif

K26_EXPORT size_t k26_moe_router_workspace(int M, int D, int E) {
  const Plan p = plan(M, D, E);
  return (size_t)p.ks * M * E * sizeof(float);
}

// Returns a cudaError_t (0 = success). Shapes are validated by the Python front door (k26/ops/router_cuda.py):
// D % 64 == 0, E <= 1024, topk <= min(32, E), n_group <= 32 dividing E, topk_group <= n_group.
// table (null: none): the expert op's routing table of these ids (csrc/moe_route.cuh) for groups of table_gt
// tokens and table_S shared-expert slots, route_table_ints(M * topk, table_S, E, table_gt) ints.
K26_EXPORT int k26_moe_router(const void* x, const void* w, const float* bias, int* barrier, float* workspace,
                              float* out_w, int64_t* out_ids, int* table, int M, int D, int E, int n_group,
                              int topk_group, int topk, int renormalize, int table_gt, int table_S, float scale,
                              int pdl, void* stream) {
  if (E > kMaxE || topk > kMaxTopk || topk > E || n_group > kMaxGroups || D % 64) return (int)cudaErrorInvalidValue;
  if (table && (table_gt < 8 || table_gt % 8 || table_S < 0)) return (int)cudaErrorInvalidValue;
  const Plan p = plan(M, D, E);
  Args a{(const __nv_bfloat16*)x, (const __nv_bfloat16*)w, bias, barrier, workspace, out_w, out_ids, table,
         M, D, E, n_group, topk_group, topk, renormalize, p.ks, p.chunks_per_ks, table_gt, table_S, scale};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
#ifdef K26_ROUTER_POLL
  if (M == 1 && n_group == 1 && topk <= kFastTopk && E <= kPollE && p.ks <= kPollKs && p.grid <= resident_grid<router_poll_kernel>())
    return (int)launch_pdl(router_poll_kernel, dim3(p.grid), dim3(kThreads), 0, pdl != 0, st, a);
#endif
  void (*kernel)(Args) = p.nt == 1 ? router_kernel<1> : p.nt == 2 ? router_kernel<2> : router_kernel<4>;
  return (int)launch_pdl(kernel, dim3(p.grid), dim3(kThreads), 0, pdl != 0, st, a);
}

// The one-token MoE block's first launch (router_kernel<1, GateUpArgs>, csrc/moe_router_gate_up.cuh): the router as
// k26_moe_router at M = 1 (no table), then in the same grid the gate/up GEMMs of the shared expert
// (shared_gate / shared_up [I, D] bf16, or both null) and of the chosen experts (w13 / s13 in csrc/moe_w4a16.cu's
// layout): act [topk (+ 1), I] bf16 for k26_moe_down_one_token (csrc/moe_w4a16.cu), the second launch. The grid is
// the resident one (blocks spin on the ids flag). Shapes are validated by the Python front door
// (k26/ops/moe_block_cuda.py); barrier as k26_moe_router's.
K26_EXPORT int k26_moe_router_gate_up(const void* x, const void* w, const float* bias, int* barrier, float* workspace,
                                      float* out_w, int64_t* out_ids, int D, int E, int n_group, int topk_group,
                                      int topk, int renormalize, float scale, const void* w13, const void* s13,
                                      const void* shared_gate, const void* shared_up, void* act, int I, int pdl,
                                      void* stream) {
  if (E > kMaxE || topk > kMaxTopk || topk > E || n_group > kMaxGroups || D % 64 || D > k26_moe::kOneTokMaxK ||
      I <= 0 || I % 64 || (shared_gate == nullptr) != (shared_up == nullptr))
    return (int)cudaErrorInvalidValue;
  const Plan p = plan(1, D, E);
  GateUpArgs a{};
  static_cast<Args&>(a) = Args{(const __nv_bfloat16*)x, (const __nv_bfloat16*)w, bias, barrier, workspace, out_w,
                               out_ids, nullptr, 1, D, E, n_group, topk_group, topk, renormalize, p.ks,
                               p.chunks_per_ks, 0, 0, scale};
  a.gu = GateUp{(const uint4*)w13, (const uint32_t*)s13, (const __nv_bfloat16*)shared_gate,
                (const __nv_bfloat16*)shared_up, (__nv_bfloat16*)act, I};
  constexpr auto kernel = router_kernel<1, GateUpArgs>;
  return (int)launch_pdl(kernel, dim3(resident_grid<kernel>()), dim3(kThreads), 0, pdl != 0,
                         static_cast<cudaStream_t>(stream), a);
}
