// Fused INT4 mixture of experts (W4A16, symmetric group 32) for Kimi K2.6.
//
//   out[t] = bf16( sum_k w[t,k] * bf16(down_e( bf16(silu(bf16 gate_e(x_t))) * bf16(up_e(x_t)) )) ),  e = ids[t,k]
//   with the shared expert (optional, bf16 [I, D] gate / up, [D, I] down, as wide as a routed one):
//   out[t] = bf16( bf16(routed sum) + shared(x_t) ), shared computed as one more expert (id E) that every
//   token visits, in the same gate/up and down grids (no separate launches), read straight from its bf16
//   rows with the same k permutation as the activations.
//
// Four launches (three when the caller passes the routing table; two for one token: see the end of this
// list), all on the caller's stream, no host sync (CUDA-graph capturable), each with programmatic dependent
// launch (see gemm_kernel; the route launch waits for the router's ids):
//   1. route:   unless the caller passes the table (the model passes the router kernel's, csrc/moe_router.cu,
//               for more than one token): one block groups the (token, k) pairs by expert in groups of 8*NT
//               tokens, the shared expert's first (csrc/moe_route.cuh).
//   2. gemm13:  (gemm_kernel, csrc/moe_gemm.cuh) per (expert group, 16-row tile pair): gate and up rows
//               interleaved in one 16-row tile, so each lane holds gate and up of the same feature and applies
//               silu(g)*u in registers.
//               The K = hidden reduction is split over the 8 warps of a block and summed in shared memory.
//   3. gemm2:   per (expert group, 16-row tile): the down projection, one warp per tile (two above 64 pairs)
//               over all of K;
//               writes each pair's bf16 expert output (the reference's per-expert rounding point).
//   4. combine: out[t] = bf16(sum_k w[t,k] * y[t,k]) in k order: deterministic, no float atomics. (Fusing
//               it into gemm2 with arrival counters measured slower: the fences stretch every block.)
// One token (decode) without a given table (csrc/moe_one_token.cuh): no route launch, each pair is its own
// group read straight from the ids ("direct"); a one-token group's gate/up stages x in shared memory and keeps
// 8 weight chunks in flight per warp; down + combine are one launch (one block per output tile, one warp per
// pair, the sum in shared memory). A few tokens (P + S <= 576, nt = 1, I <= 256: K2.6 at TP8 up to M = 64):
// gemm2 + combine are one launch too (csrc/moe_down_combine.cuh: a block per 32 output rows over every group,
// one wave; TP8 block 4-20 % faster, the verify N = 16 step 7.77 -> 7.24 ms,
// 2026-12-02-bench_moe-down-combine-h200.md). Both bit-identical to the four-launch path.
// Groups from the ids (moe_cuda.groups_from_ids, by default up to 16 pairs: two tokens; flags bit 2): no table
// and no routing launch where the one-launch down + combine serves; each gate/up block finds its table group
// from the ids (csrc/moe_gemm.cuh group_from_ids) and the down + combine blocks build their own table, so the
// router builds none (2 tokens 40.9 -> 38.4 µs, slower from 4: 2026-12-06-moe-groups-tree-heap-session30-h100.md).
// `moe_one_token` (opt-in: measured slower) runs one token's gate/up in the router's grid instead
// (csrc/moe_router_gate_up.cuh) and only the down + combine here (k26_moe_down_one_token): two launches a layer.
//
// "Swap AB": the weights are the mma A operand (16 output features per tile) and the few tokens per
// expert are the n = 8 columns, so small batches waste no weight bandwidth. Weight layout (repacked
// once at load by k26/ops/moe_cuda.py): per (expert, 16-row tile, 64-wide k chunk) 32 lanes x 16 B;
// lane (g = lane/4, t = lane%4) holds rows g and g+8 at k in [16t, 16t+16) as 4 words, word j being the
// m16n8k16 A fragment of k-step j with nibbles ordered [0,2,4,6,1,3,5,7]-style for lop3 extraction.
// The k index of mma step j is permuted (lane t owns 16 consecutive k) so the B fragment of a lane is
// 32 contiguous activation bytes: two 16-byte loads, no shuffles, no ldmatrix needed for B.
// Scales: one bf16 per (row, group of 32), 16 words per chunk, word 2g + group = (row g, row g+8) of that
// group; lane (g, t) reads word 2g + t/2 (the lanes of a pair share it: 64 B of scales per 512 B chunk).
// Dequant: (nibble | 0x4300) is bf16 128+u; minus 136 gives q exactly; one bf16 multiply by the scale
// rounds once, bit-identical to compressed-tensors' bf16(q*s).
//
// Legality: warp-level mma.sync.m16n8k16 bf16, griddepcontrol and prefetch only (no warpgroup MMA, no tensor
// memory, no TMA), <= 32 KB static shared memory per block: legal on sm_120 (99 KB limit) and sm_90; built for
// sm_90a and sm_120a.
// Speed and its benchmark: profiling/bench_moe.py (--block: the whole MoE block), results in profiling/results/
// (H200, TP8 rank, cold L2, graph replay): router + experts + shared expert, M = 1 26.3-27.0 µs in 3 launches
// (2026-12-01-bench_moe_block-h200-run7.md; 37.5 µs in 5 launches before), M = 64 237 µs; TP1 M = 1 103 µs
// (67 % of copy). PDL 3.4 µs less at M = 1, 10.6 at M = 64 (run 3). The down GEMM with two tiles per warp above
// 64 pairs and the routing launch under PDL: M = 16 122.9 -> 118 µs (58 % of copy), skewed M = 64 137.9 -> 128
// (2026-12-01-bench_k26-session10-h200.md; four tiles per warp measured slower).
// Above 64 pairs the two-tile gate/up GEMM runs three blocks per SM on sm_90 (kGateUpThreePerSM, csrc/moe_mma.cuh:
// one wave for the verify N = 16 step's ~430 blocks; 6.86 / 6.91 -> 6.80 / 6.79 ms,
// 2026-12-04-moe-gate-up-3per-sm-session17-h200.md).
// Tried and dropped (2026-12-01-bench_moe-session11-h200.md): blocks looping over expert groups with a one-wave
// grid (no empty blocks; the loop took the M = 16 gate/up kernel from 128 to 201 registers, or ~280 B of spills
// at 128); NT = 2 / 4 at M = 16 (slower uniform, no gain skewed, verify N = 16 7.69 -> 8.31 ms); the gate/up
// blocks prefetching their expert's down weights into L2 (M = 1 24.6 -> 25.3-26.0 µs, M = 16 slower). Also dropped
// (2026-12-02-bench_moe-staged-gate-up-h200.md): a gate/up GEMM for > 64 pairs streaming weights, scales and
// activations through a lane-private cp.async ring (4 slots a warp, 72 KB a block) in a one-wave grid whose
// blocks loop over the groups — block M = 16 100.9 -> 105.5 µs uniform, 41.0 -> 51.5 skewed, slower at every M
// and shape (2 blocks per SM at 128 registers: the shared expert's register-held tiles; 3 blocks spill). And
// (2026-12-02-bench_moe-wide-gate-up-h200.md): four gate/up row tiles per warp above 64 pairs (half the blocks,
// one wave at M = 16, 120 registers, two chunks in flight) — block M = 16 101.3 -> 108.2 µs uniform, 41.4 -> 43.5
// skewed, verify N = 16 step 7.14 -> 7.32 ms.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "globaltimer.cuh"

// Phase timestamps for profiling/debug/moe_trace.py (built with -DK26_MOE_TRACE; absent otherwise): table 0
// the gate/up GEMM, 1 the down GEMM / down_combine_one_token; a row per block, thread 0 stamps.
#ifdef K26_MOE_TRACE
__device__ unsigned long long g_moe_trace[2][1024][16];
// Stamp 0 also records the block's SM (slot 15, %smid + 1: 0 stays "not stamped").
#define MOE_TRACE(table, k)                                                          \
  {                                                                                  \
    const unsigned row_ = blockIdx.y * gridDim.x + blockIdx.x;                       \
    if (threadIdx.x == 0 && row_ < 1024) {                                           \
      g_moe_trace[table][row_][k] = k26_globaltimer();                               \
      if ((k) == 0) g_moe_trace[table][row_][15] = k26_smid() + 1;                   \
    }                                                                                \
  }
#else
#define MOE_TRACE(table, k)
#endif

#include "moe_down_combine.cuh"
#include "moe_gemm.cuh"
#include "moe_mma.cuh"
#include "moe_one_token.cuh"
#include "moe_route.cuh"
#include "pdl.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using namespace k26_moe;

constexpr int kRouteThreads = 512;  // the table builder takes any E and P (ids cached up to two per thread)

// ---------------------------------------------------------------------------------------------
// 1. Routing (when the caller passes no table): one block groups the pairs by
// expert (csrc/moe_route.cuh). Pairs with an id outside [0, E) are dropped (never read).
__global__ void __launch_bounds__(kRouteThreads) route_kernel(const int64_t* __restrict__ ids, int P, int E, int gt,
                                                             int S, int* __restrict__ table) {
  extern __shared__ int sm[];
  pdl_trigger();  // the gate/up GEMM's shared-expert blocks need no routing: let them start now
  pdl_wait();     // the ids come from the router kernel (launched with PDL, this launch overlaps its tail)
  build_route_table([=](int p) { return ids[p]; }, P, E, gt, S, route_table_at(table, P, S, E, gt), sm);
}

struct Workspace {
  int* table;  // the routing table (csrc/moe_route.cuh), unless the caller passes one
  __nv_bfloat16 *act, *y;
};

size_t align_up(size_t v) { return (v + 255) & ~size_t(255); }

// S = M slots for the shared expert (0 without it) after the P routed pairs.
size_t carve(void* base, int M, int D, int I, int E, int topk, int nt, int shared, Workspace* ws) {
  const int P = M * topk, S = shared ? M : 0;
  size_t off = 0;
  char* b = static_cast<char*>(base);
  auto take = [&](size_t bytes) { char* p = b ? b + off : nullptr; off += align_up(bytes); return p; };
  int* table = (int*)take(route_table_ints(P, S, E, 8 * nt) * 4);
  __nv_bfloat16* act = (__nv_bfloat16*)take(((size_t)P + S) * I * 2);
  __nv_bfloat16* y = (__nv_bfloat16*)take(((size_t)P + S) * D * 2);
  if (ws) *ws = Workspace{table, act, y};
  return off;
}

struct Shared {  // the shared expert's bf16 weights, or all nullptr
  const __nv_bfloat16 *gate, *up, *down;
};

// Kernel launch on `st` (pdl.cuh; the kernels' pdl_wait / pdl_trigger say what may overlap).
template <typename... Params, typename... Args>
cudaError_t launch_on(void (*kernel)(Params...), dim3 grid, int threads, bool pdl, cudaStream_t st, Args... args) {
  return launch_pdl(kernel, grid, dim3(threads), 0, pdl, st, args...);
}

// One token's down projection + weighted combine in one launch (csrc/moe_one_token.cuh) over act [topk (+ 1: the
// shared expert's slot, when sd), I], the ids read directly (topk <= kDownOneTokPairs).
cudaError_t launch_down_one_token(const __nv_bfloat16* act, const void* w2, const void* s2, const int64_t* ids,
                                  const float* topw, void* out, int D, int I, int E, int topk,
                                  const __nv_bfloat16* sd, bool pdl, cudaStream_t st) {
  const int tiles2 = D / 16;
  if (I <= 64 * kDownStageChunks)  // the block's weights staged in shared memory before the wait
    return launch_on(down_combine_one_token_staged, dim3(tiles2), kDownOneTokThreads, pdl, st, act,
                     (const uint4*)w2, (const uint32_t*)s2, I, tiles2, ids, topw, topk, E, sd, (__nv_bfloat16*)out);
  return launch_on(down_combine_one_token, dim3(tiles2), kDownOneTokThreads, pdl, st, act, (const uint4*)w2,
                   (const uint32_t*)s2, I, tiles2, ids, topw, topk, E, sd, (__nv_bfloat16*)out);
}

// `table`: a routing table of exactly these ids, group size 8 * NT and S (nullptr: route here).
// RT1 / RT2: 16-row tiles per warp in the gate/up / down GEMM.
template <int NT, int RT1, int RT2>
cudaError_t launch(const void* x, const void* w13, const void* s13, const void* w2, const void* s2, const int64_t* ids,
                   const float* topw, void* out, void* ws_base, int* table, int M, int D, int I, int E, int topk,
                   Shared sh, bool pdl, bool split_down, bool from_ids, cudaStream_t st) {
  Workspace ws;
  const int S = sh.gate ? M : 0;
  carve(ws_base, M, D, I, E, topk, NT, S, &ws);
  const int P = M * topk, tiles2 = D / 16;
  // One token (decode) and no table given: every pair is its own group, read straight from the ids by the
  // GEMMs, so no routing launch (~3.7 µs in the TP8 M = 1 block). Exact for any ids (a repeated expert would
  // be read twice); more tokens share experts, so they are grouped by route_kernel — or, where the one-launch
  // down + combine serves and `from_ids`, by the GEMMs themselves (`own`: the gate/up blocks group_from_ids, the
  // down + combine blocks their own table): no routing launch and no table from the router.
  const int64_t* direct = M == 1 && table == nullptr ? ids : nullptr;
  const bool down_combine = NT == 1 && !direct && !split_down && P + S <= kDownCombineMaxSlots &&
                            I <= 64 * kDownCombineMaxChunks && tiles2 % kDownCombineRT == 0;
  const bool own = from_ids && table == nullptr && down_combine && P <= kOwnMaxPairs && E <= kOwnMaxExperts;
  const int G = direct ? (S + 8 * NT - 1) / (8 * NT) + P : route_groups(P, S, E, 8 * NT);
  if (table == nullptr && direct == nullptr && !own) {
    table = ws.table;
    const cudaError_t e = launch_pdl(route_kernel, dim3(1), dim3(kRouteThreads), 3 * E * sizeof(int), pdl, st, ids, P,
                                     E, 8 * NT, S, table);
    if (e != cudaSuccess) return e;
  }
  const RouteTable rt = route_table_at(table ? table : ws.table, P, S, E, 8 * NT);  // unread when direct
  // gate/up: I/8 interleaved tiles, RT1 per warp, K = D split over the 8 warps of a block.
  // (Blocks of 6 / 4 warps, 4 / 6 per SM, so the verify step's ~430 two-tile blocks fit one wave: all groups
  // start at once, but the grid shares the same bandwidth — verify N = 16 6.77 -> 6.79 ms (6 warps) and
  // 6.79 -> 7.03 ms (4 warps), dropped: 2026-12-04-moe-gate-up-session18-h200.md.)
  constexpr int WK1 = 8;
  const int tiles13 = I / 8;
  auto* gate_up = gemm_kernel<RT1, NT, WK1, 1, true, (NT == 1 ? 3 : 1)>;
  cudaError_t err = launch_pdl(gate_up, dim3(tiles13 / RT1, G), dim3(32 * WK1), 0, pdl, st,
                               (const __nv_bfloat16*)x, (const uint4*)w13, (const uint32_t*)s13, D, tiles13, topk,
                               rt.sorted, rt.expert, rt.start, rt.len, rt.num_groups, ws.act, I, E, P, S, sh.gate,
                               sh.up, direct, own ? ids : nullptr);
  if (err != cudaSuccess) return err;
  if (direct && topk <= kDownOneTokPairs)  // decode: down + combine in one launch
    return launch_down_one_token(ws.act, w2, s2, ids, topw, out, D, I, E, topk, sh.down, pdl, st);
  if (down_combine) {  // a few tokens: down + combine in one launch
    const int Gd = route_groups(P, S, E, 8);  // the table's groups (own: the block's own table)
    const size_t smem = down_combine_smem(P, S, Gd, E, own);
    if (smem + 1024 > 48 * 1024) {  // 48 KB without the opt-in, static (build_route_table's 0.5 KB) included
      const cudaError_t e = cudaFuncSetAttribute(down_combine_grouped, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)smem);
      if (e != cudaSuccess) return e;
    }
    return launch_pdl(down_combine_grouped, dim3(tiles2 / kDownCombineRT), dim3(32 * kDownCombineWarps), smem,
                      pdl, st, (const __nv_bfloat16*)ws.act, (const uint4*)w2, (const uint32_t*)s2, I, tiles2, rt, Gd,
                      ids, topw, M, topk, E, S, sh.down, (__nv_bfloat16*)out, (int)own);
  }
  // down: D/16 tiles, RT2 per warp, 8 warps per block, K = I.
  constexpr int WM2 = 8;
  err = launch_on(gemm_kernel<RT2, NT, 1, WM2, false, (NT == 1 ? (RT2 == 1 ? 3 : 2) : 1)>,
                  dim3((tiles2 / RT2 + WM2 - 1) / WM2, G), 32 * WM2,
                  pdl, st, (const __nv_bfloat16*)ws.act, (const uint4*)w2, (const uint32_t*)s2, I, tiles2, topk,
                  rt.sorted, rt.expert, rt.start, rt.len, rt.num_groups, ws.y, D, E, P, S, sh.down,
                  (const __nv_bfloat16*)nullptr, direct, (const int64_t*)nullptr);
  if (err != cudaSuccess) return err;
  const int threads = 128;
  return launch_on(combine_kernel, dim3((D / 8 + threads - 1) / threads, M), threads, pdl, st,
                   (const __nv_bfloat16*)ws.y, topw, ids, E, topk, D, (__nv_bfloat16*)out,
                   (const __nv_bfloat16*)(S ? ws.y + (size_t)P * D : nullptr));
}

}  // namespace

#ifdef K26_MOE_TRACE
K26_TRACE_EXPORTS(k26_moe_trace, k26_moe_trace_reset, g_moe_trace)
#endif

K26_EXPORT size_t k26_moe_w4a16_workspace(int M, int D, int I, int E, int topk, int nt, int shared) {
  return carve(nullptr, M, D, I, E, topk, nt, shared, nullptr);
}

K26_EXPORT size_t k26_moe_route_table_ints(int M, int E, int topk, int nt, int shared) {
  return route_table_ints(M * topk, shared ? M : 0, E, 8 * nt);
}

// Returns a cudaError_t (0 = success). Shapes are validated by the Python front door. shared_gate/up [I, D] and
// shared_down [D, I] bf16 (all null: no shared expert) run as expert id E in the same grids. table: the routing
// table of these ids for this nt and shared (csrc/moe_route.cuh), or null (routed here). flags: bit 0 launches
// with PDL; bit 1 runs the down GEMM + combine launches where down_combine_grouped would serve (same bits: the
// A/B and the bit-identity test); bit 2, without a table where down_combine_grouped serves, groups the pairs in
// the GEMMs from the ids (no routing launch; same bits).
K26_EXPORT int k26_moe_w4a16(const void* x, const void* w13, const void* s13, const void* w2, const void* s2,
                             const int64_t* ids, const float* topw, void* out, void* workspace, int M, int D, int I,
                             int E, int topk, int nt, const void* shared_gate, const void* shared_up,
                             const void* shared_down, void* table, int flags, void* stream) {
  const bool pdl = flags & 1, split = flags & 2, from_ids = flags & 4;
  int* tab = static_cast<int*>(table);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const Shared sh{(const __nv_bfloat16*)shared_gate, (const __nv_bfloat16*)shared_up,
                  (const __nv_bfloat16*)shared_down};
  // Few pairs: one gate/up tile per warp doubles the blocks in flight; many: two tiles share B loads, and the
  // down GEMM's warps take two tiles each (half the blocks: its grid was several waves of short blocks).
  // (One tile per warp up to 128 / 256 pairs measured slower with the one-launch down + combine: M = 16 block
  // uniform 100.5 -> 106.8 / 109.2 µs, skewed 40.6 -> 44.4 / 45.2, verify N = 16 step 7.18 -> 7.45 ms;
  // 2026-12-02-bench_moe-down-combine-h200.md.)
  const bool few = M * topk <= 64;
  switch (nt) {
    case 1:
      return few ? launch<1, 1, 1>(x, w13, s13, w2, s2, ids, topw, out, workspace, tab, M, D, I, E, topk, sh, pdl, split, from_ids, st)
                 : launch<1, 2, 2>(x, w13, s13, w2, s2, ids, topw, out, workspace, tab, M, D, I, E, topk, sh, pdl, split, from_ids, st);
    case 2: return launch<2, 2, 1>(x, w13, s13, w2, s2, ids, topw, out, workspace, tab, M, D, I, E, topk, sh, pdl, split, from_ids, st);
    case 4: return launch<4, 1, 1>(x, w13, s13, w2, s2, ids, topw, out, workspace, tab, M, D, I, E, topk, sh, pdl, split, from_ids, st);
    default: return (int)cudaErrorInvalidValue;
  }
}

// The one-token MoE block's second launch: down projection + weighted combine over act [topk (+ 1), I] bf16,
// written by k26_moe_router_gate_up (csrc/moe_router.cu) with the ids and weights it selected; shared_down [D, I]
// bf16 or null (no shared expert: act has topk rows). The ids are read before the grid-dependency wait: the
// gate/up launch releases its dependents only once they are written. Returns a cudaError_t (0 = success); shapes
// are validated by the Python front door (k26/ops/moe_block_cuda.py).
K26_EXPORT int k26_moe_down_one_token(const void* act, const void* w2, const void* s2, const int64_t* ids,
                                      const float* topw, void* out, int D, int I, int E, int topk,
                                      const void* shared_down, int pdl, void* stream) {
  if (topk < 1 || topk > kDownOneTokPairs || D % 16 || I <= 0 || I % 64) return (int)cudaErrorInvalidValue;
  return (int)launch_down_one_token((const __nv_bfloat16*)act, w2, s2, ids, topw, out, D, I, E, topk,
                                    (const __nv_bfloat16*)shared_down, pdl != 0, static_cast<cudaStream_t>(stream));
}
