// Small-M dense linear for decode and verify: y[m, n] = bf16( sum_k x[m, k] * W[n, k] ) (+ residual[m, n]),
// bf16 x / W / y, fp32 accumulation, M <= 64 tokens, W in nn.Linear's own [N, K] row-major layout (no repack).
// One launch per projection, in one of two modes (k26/ops/linear_cuda.py plans it):
//
// Tile mode (S = 0, the default; linear_tile_kernel): a block per 16-row tile of W, its 8 warps splitting K and
// reducing in shared memory in warp order, x read straight from L1 / L2. Batch-invariant (a row of y has the
// same bits at every M), so a verify step reproduces decode's projections bit for bit.
// Split-K (S >= 1, on request; linear_smallm_kernel): grid (N / 64 row blocks, S k-splits, G groups); 4 warps
// per block, each warp owns one 16-row tile of W over the split's k range, x of that range staged once in
// shared memory (cp.async; rows padded by 64 B so the 8 rows of a quarter-warp read hit distinct banks).
// SwiGLU mode (k26_linear_swiglu, torch.ops.k26.linear_swiglu; tile mode only): W is an MLP's [gate; up] stack
// [2 I, K]; a block owns 8 output features, its 16-row tile the 8 gate rows (a lane's row g) and the 8 matching
// up rows (row g + 8, I rows further), and its epilogue writes swiglu(gate, up) (linear_tile.cuh): gate / up and
// SiLU·up in one launch, I columns out. Its sums are the plain tile mode's of the same rows, bit for bit.
// Both stream W with 16-byte ld.global.nc loads, two register batches of units (32 k each) in flight per lane
// (software double buffer). Groups (blockIdx.z) are independent matrices at fixed strides (the per-head W_UV
// of MLA); a plain linear is G = 1.
//
// "Swap AB": W rows are the mma A operand (m16) and the tokens the n8 columns, so M = 1..64 costs the same
// weight bytes; tokens come in groups of 8 (MT = 1, 2, 4, 8 groups per block).
// k permutation: in a 32-wide unit, lane (g = lane / 4, t = lane % 4) loads W[row g], W[row g + 8] and
// x[token g] at k = 8t .. 8t + 7 (one 16-byte load each); mma step s in {0, 1} uses words 2s, 2s + 1 of
// those loads as the fragments of logical k {2t, 2t + 1} and {2t + 8, 2t + 9}. A and B share the
// permutation, so the dot products are exact reorderings: no ldmatrix, no shared memory for W.
//
// Split-K without a reduce kernel: with S > 1 each block writes its fp32 partial tile to a workspace and
// bumps a per-(group, row block) counter; the last of the S blocks sums the S partials in split order
// (deterministic, independent of arrival order), writes y and resets the counter to 0 for the next call.
// Counters are kernel-owned: zero on allocation, zero after every completed launch.
//
// Programmatic dependent launch: two weight batches are issued before cudaGridDependencySynchronize
// (weights never depend on the previous kernel; x, residual and the counters do), and the trigger for the
// next kernel fires after the main loop.
//
// Legality: mma.sync.m16n8k16 bf16, cp.async, ld.global.nc and griddepcontrol only (no warpgroup MMA, tensor
// memory or TMA); < 48 KB shared memory per block (k26/ops/linear_cuda.py plans 47 KB of staged x; tile mode
// <= 32 KB). Built for sm_90a and sm_120a.
// Speed (H200, profiling/results/2026-12-01-bench_linear-h200-tile.md, cold L2): tile mode 1.08-1.54x of the
// streaming floor at M = 1 (lm_head shard 93 % of copy bandwidth; q_a+kv_a 10.7 µs vs cuBLAS 12.8), 1.2-2.1x at
// M = 16, faster than split-K at its best split count everywhere but W_UK^T at M = 16; at M = 64 2-4x slower than
// cuBLAS (every 16-row block reads all of x). In the compiled K2.6 step
// (profiling/results/2026-12-01-bench_k26-session9-h200.md) the MLA projections went from 33.5 to 27.1 µs per layer
// at one token and the decode step from 5.08 to 4.80 ms. The deep variant (one-wave grids, <= 16 rows):
// q_a+kv_a 10.1 µs at M = 1 (1.19x its floor), 12.3 at M = 16
// (profiling/results/2026-12-01-bench_k26-session10-h200.md; prefetching the rest of its weights to L2 before
// the wait measured no gain there and was dropped).
// Benchmarks: profiling/bench_linear.py (one projection), profiling/bench_k26.py --variants (the step).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "linear_tile.cuh"
#include "pdl.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using namespace k26_linear;

constexpr int kWarps = 4, kThreads = 32 * kWarps, kRows = 16 * kWarps;
constexpr int kBatch = 4;      // units per register batch; two batches in flight
constexpr int kPad = 32;       // bf16 elements of row padding in the staged x (64 B)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

template <int MT>
__device__ __forceinline__ void compute_batch(float (&acc)[MT][4], const uint4 (&w)[kBatch][2],
                                              const __nv_bfloat16* xs_lane, int ldx, int u, int u_begin, int u_end) {
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    if (u + i >= u_end) break;
    const __nv_bfloat16* xu = xs_lane + (u + i - u_begin) * kUnit;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const uint4 b = *reinterpret_cast<const uint4*>(xu + j * 8 * ldx);
      mma_bf16(acc[j], w[i][0].x, w[i][1].x, w[i][0].y, w[i][1].y, b.x, b.y);
      mma_bf16(acc[j], w[i][0].z, w[i][1].z, w[i][0].w, w[i][1].w, b.z, b.w);
    }
  }
}


template <int MT>
__global__ void __launch_bounds__(kThreads) linear_smallm_kernel(const Params p) {
  extern __shared__ __align__(16) __nv_bfloat16 xs[];  // [8 * MT, units_per_split * 32 + kPad]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int grp = blockIdx.z, split = blockIdx.y;
  const int n_tile = blockIdx.x * kRows + warp * 16;
  const int units = (p.K + kUnit - 1) / kUnit;
  const int u_begin = split * p.units_per_split, u_end = min(units, u_begin + p.units_per_split);
  const int ldx = p.units_per_split * kUnit + kPad;
  const bool active = n_tile < p.N;  // warp-uniform: tiles past N load and compute nothing

  const __nv_bfloat16* wg = p.w + grp * p.w_gs;
  const __nv_bfloat16* w_lo = wg + (long long)min(n_tile + g, p.N - 1) * p.w_ld;  // clamped rows are discarded
  const __nv_bfloat16* w_hi = wg + (long long)min(n_tile + g + 8, p.N - 1) * p.w_ld;
  const int kt = 8 * t;

  uint4 wa[kBatch][2], wb[kBatch][2];
  if (active) {  // two batches in flight across the dependency wait and the staging of x
    load_batch(wa, w_lo, w_hi, u_begin, u_end, kt, p.K);
    load_batch(wb, w_lo, w_hi, u_begin + kBatch, u_end, kt, p.K);
  }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // x, residual and counters may come from the previous kernel
#endif

  // Stage x[:, block's k range] (rows >= M and k >= K as zeros).
  const int chunks_per_row = (u_end - u_begin) * (kUnit / 8);
  const __nv_bfloat16* xg = p.x + grp * p.x_gs;
  for (int c = threadIdx.x; c < 8 * MT * chunks_per_row; c += kThreads) {
    const int m = c / chunks_per_row, kk = (c % chunks_per_row) * 8, k = u_begin * kUnit + kk;
    __nv_bfloat16* dst = xs + m * ldx + kk;
    if (m < p.M && k < p.K) cp_async16(dst, xg + m * p.x_ld + k);
    else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();

  float acc[MT][4] = {};
  if (active) {
    const __nv_bfloat16* xs_lane = xs + g * ldx + kt;
    for (int u = u_begin; u < u_end; u += 2 * kBatch) {  // each buffer refilled as soon as it is consumed
      compute_batch<MT>(acc, wa, xs_lane, ldx, u, u_begin, u_end);
      load_batch(wa, w_lo, w_hi, u + 2 * kBatch, u_end, kt, p.K);
      compute_batch<MT>(acc, wb, xs_lane, ldx, u + kBatch, u_begin, u_end);
      load_batch(wb, w_lo, w_hi, u + 3 * kBatch, u_end, kt, p.K);
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();  // the next kernel may start streaming its weights
#endif

  // Accumulator (j, c): row n_tile + g + 8 * (c / 2), token 8j + 2t + c % 2.
  const __nv_bfloat16* res = p.residual ? p.residual + grp * p.y_gs : nullptr;
  __nv_bfloat16* yg = p.y + grp * p.y_gs;
  if (p.S == 1) {
    if (!active) return;
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = n_tile + g + 8 * (c / 2), m = 8 * j + 2 * t + c % 2;
        if (n < p.N && m < p.M) yg[m * p.y_ld + n] = finish(acc[j][c], res, m * p.y_ld + n);
      }
    return;
  }

  float* part = p.partial + (long long)grp * p.S * p.M * p.N;
  if (active) {
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = n_tile + g + 8 * (c / 2), m = 8 * j + 2 * t + c % 2;
        if (n < p.N && m < p.M) __stcg(part + ((long long)split * p.M + m) * p.N + n, acc[j][c]);
      }
  }
  // Cooperative groups' grid-sync pattern: the barrier orders the block's partial stores before thread 0,
  // whose (cumulative) fence publishes them before its arrival; one fence per block, not one per thread
  // (a fence is a MEMBAR.SC.GPU: per thread it stretched every block's tail).
  __syncthreads();
  __shared__ int is_last;
  int* counter = p.counters + grp * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(counter, 1) == p.S - 1;
    if (is_last) __threadfence();  // acquire: the other splits' partials before this block reads them
  }
  __syncthreads();
  if (!is_last) return;
  const int n0 = blockIdx.x * kRows;
  for (int e = threadIdx.x; e < kRows * p.M; e += kThreads) {
    const int n = n0 + e % kRows, m = e / kRows;
    if (n >= p.N) continue;
    float s = 0.f;
    for (int sp = 0; sp < p.S; ++sp) s += __ldcg(part + ((long long)sp * p.M + m) * p.N + n);
    yg[m * p.y_ld + n] = finish(s, res, m * p.y_ld + n);
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (stream order; PDL waits on completion)
}

// The current device's SM count (host side, queried once per device; threads racing on the first query
// store the same value). Only the variant's speed depends on it, never the bits.
int sms() {
  static std::atomic<int> count[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int n = count[dev].load(std::memory_order_relaxed);
  if (n == 0 && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
    count[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Tile mode (S == 0): csrc/linear_tile.cuh. SWIGLU (linear_swiglu_kernel): a block owns 8 output features, its
// 16-row tile the 8 gate rows (the lanes' row g) and the 8 matching up rows (row g + 8, p.up rows further).
template <int MT, int B, bool SWIGLU>
__device__ __forceinline__ void tile_body(const Params& p) {
  __shared__ float red[kTileWarps][MT * 4][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, kt = 8 * t;
  const int grp = blockIdx.z, n_tile = blockIdx.x * (SWIGLU ? 8 : 16);
  const int units = (p.K + kUnit - 1) / kUnit;
  const int u_begin = warp * units / kTileWarps, u_end = (warp + 1) * units / kTileWarps;
  const __nv_bfloat16* wg = p.w + grp * p.w_gs;
  const __nv_bfloat16* w_lo = wg + (long long)min(n_tile + g, p.N - 1) * p.w_ld;  // clamped rows are discarded
  const __nv_bfloat16* w_hi =
      wg + (long long)(SWIGLU ? p.up + min(n_tile + g, p.N - 1) : min(n_tile + g + 8, p.N - 1)) * p.w_ld;
  const __nv_bfloat16* xr = p.x + grp * p.x_gs + g * p.x_ld + kt;
  const long long x_tile = 8 * p.x_ld;
  const int tiles_live = (p.M - g + 7) / 8;  // j with 8j + g < M

  uint4 wa[B][2], wb[B][2];
  load_batch(wa, w_lo, w_hi, u_begin, u_end, kt, p.K);  // two weight batches in flight across the wait
  load_batch(wb, w_lo, w_hi, u_begin + B, u_end, kt, p.K);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // x and residual may come from the previous kernel
#endif
  float acc[MT][4] = {};
  tile_loop<MT, B>(acc, wa, wb, w_lo, w_hi, xr, x_tile, tiles_live, u_begin, u_end, kt, p.K);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();  // the next kernel may start streaming its weights
#endif
  tile_store<MT, SWIGLU>(acc, red, p, grp, n_tile);
}
template <int MT, int B, int MINB>
__global__ void __launch_bounds__(kTileThreads, MINB) linear_tile_kernel(const Params p) {
  tile_body<MT, B, false>(p);
}
template <int MT, int B, int MINB>
__global__ void __launch_bounds__(kTileThreads, MINB) linear_swiglu_kernel(const Params p) {
  tile_body<MT, B, true>(p);
}
#if defined(K26_LINEAR_RT2) || defined(K26_LINEAR_RT2_ALL)
// -DK26_LINEAR_RT2 (an A/B side, k26/ops/build.py VARIANTS; not measured yet): at 9-16 tokens on grids beyond one
// wave (o_proj's 448 tiles, the lm_head shard's 1,280), a warp owns two 16-row tiles of W over its k range, so
// each x fragment it loads feeds both: half the x loads a weight byte (at 16 tokens tile mode loads as many x
// bytes as weight bytes, and o_proj reads 1.5x its floor against 1.3x at one token, H100 2026-12-07). One unit a
// batch (B = 1) keeps the weight bytes in flight a warp as the default's. Each tile's units are accumulated in
// the same order as the default's, so the bits are the same. (Session 22's two-tile variant, a block of two
// tiles at <= 8 tokens with the x loads unchanged, measured slower: 2026-12-05-session22-h200.md.)
// -DK26_LINEAR_RT2_ALL (another A/B side, not measured): the same from one token (MT 1) and for the SwiGLU
// mode (two 8-feature tiles a block), beyond one wave. Session 22's variant, re-tried as its file asked once
// the weight loads stay above the grid-dependency wait (session 24): the grids then fit one wave where the
// default's do not — the drafter's gate / up (288 tiles over 264 two-a-SM slots on an H200), its down and
// o_proj (448) — so no second wave's tail.
// Two blocks an SM on sm_90a (<= 120 registers); on sm_120a one at 9-16 tokens (154 registers: at the
// 128-register cap it spilled 16 B), two at one token.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define K26_RT2_MINB 1
#else
#define K26_RT2_MINB 2
#endif
template <int MT, int B, bool SWIGLU>
__global__ void __launch_bounds__(kTileThreads, MT == 1 ? 2 : K26_RT2_MINB) linear_tile2_kernel(const Params p) {
  __shared__ float red[kTileWarps][MT * 4][32];
  constexpr int TR = SWIGLU ? 8 : 16;  // output features a tile (SwiGLU: 8 gate rows and their 8 up rows)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, kt = 8 * t;
  const int grp = blockIdx.z, n0 = blockIdx.x * 2 * TR;
  const int units = (p.K + kUnit - 1) / kUnit;
  const int u_begin = warp * units / kTileWarps, u_end = (warp + 1) * units / kTileWarps;
  const __nv_bfloat16* wg = p.w + grp * p.w_gs;
  const __nv_bfloat16 *w_lo[2], *w_hi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // clamped rows are discarded (tile_body's rows for n_tile = n0 + TR r)
    const int n = min(n0 + TR * r + g, p.N - 1);
    w_lo[r] = wg + (long long)n * p.w_ld;
    w_hi[r] = wg + (long long)(SWIGLU ? p.up + n : min(n0 + TR * r + g + 8, p.N - 1)) * p.w_ld;
  }
  const __nv_bfloat16* xr = p.x + grp * p.x_gs + g * p.x_ld + kt;
  const long long x_tile = 8 * p.x_ld;
  const int tiles_live = (p.M - g + 7) / 8;

  uint4 wa[2][B][2], wb[2][B][2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // two weight batches of each tile in flight across the wait
    load_batch(wa[r], w_lo[r], w_hi[r], u_begin, u_end, kt, p.K);
    load_batch(wb[r], w_lo[r], w_hi[r], u_begin + B, u_end, kt, p.K);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // x may come from the previous kernel
#endif
  float acc[2][MT][4] = {};
  uint4 xa[B][MT], xb[B][MT];
  load_x<MT, B>(xa, xr, x_tile, tiles_live, u_begin, u_end, kt, p.K);
  load_x<MT, B>(xb, xr, x_tile, tiles_live, u_begin + B, u_end, kt, p.K);
  for (int u = u_begin; u < u_end; u += 2 * B) {  // tile_loop's order, each x batch used by both tiles
#pragma unroll
    for (int r = 0; r < 2; ++r) compute_tile_batch<MT, B>(acc[r], wa[r], xa, u, u_end);
#pragma unroll
    for (int r = 0; r < 2; ++r) load_batch(wa[r], w_lo[r], w_hi[r], u + 2 * B, u_end, kt, p.K);
    load_x<MT, B>(xa, xr, x_tile, tiles_live, u + 2 * B, u_end, kt, p.K);
#pragma unroll
    for (int r = 0; r < 2; ++r) compute_tile_batch<MT, B>(acc[r], wb[r], xb, u + B, u_end);
#pragma unroll
    for (int r = 0; r < 2; ++r) load_batch(wb[r], w_lo[r], w_hi[r], u + 3 * B, u_end, kt, p.K);
    load_x<MT, B>(xb, xr, x_tile, tiles_live, u + 3 * B, u_end, kt, p.K);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
  tile_store<MT, SWIGLU>(acc[0], red, p, grp, n0);
  __syncthreads();  // warp 0 has read the first tile's sums before the second's are written
  tile_store<MT, SWIGLU>(acc[1], red, p, grp, n0 + TR);
}
#endif

// The tile kernel of MT token tiles at its default batch and occupancy.
template <int MT, bool SWIGLU>
constexpr auto tile_kernel() {
  if constexpr (SWIGLU) return linear_swiglu_kernel<MT, tile_batch<MT>(), tile_blocks<MT>()>;
  else return linear_tile_kernel<MT, tile_batch<MT>(), tile_blocks<MT>()>;
}
template <int MT, bool SWIGLU>
constexpr auto deep_kernel() {
  if constexpr (SWIGLU) return linear_swiglu_kernel<MT, kDeepBatch, 1>;
  else return linear_tile_kernel<MT, kDeepBatch, 1>;
}

// Tile mode's launch: the deep variant where the grid is at most one block per SM (MT <= 2), else the default.
template <bool SWIGLU>
cudaError_t launch_tile(const Params& p, dim3 grid, bool pdl, cudaStream_t st) {
  const int mt = (p.M + 7) / 8;
  const dim3 block(kTileThreads);
  const bool deep = (long long)grid.x * grid.z <= sms();
#if defined(K26_LINEAR_RT2_ALL)
  if (mt <= 2 && !deep) {  // two tiles a block: half the grid
    const dim3 half((grid.x + 1) / 2, 1, grid.z);
    if (mt == 1) return launch_pdl(linear_tile2_kernel<1, 1, SWIGLU>, half, block, 0, pdl, st, p);
    return launch_pdl(linear_tile2_kernel<2, 1, SWIGLU>, half, block, 0, pdl, st, p);
  }
#elif defined(K26_LINEAR_RT2)
  if (!SWIGLU && mt == 2 && !deep)
    return launch_pdl(linear_tile2_kernel<2, 1, false>, dim3((p.N + 31) / 32, 1, grid.z), block, 0, pdl, st, p);
#endif
  if (mt == 1 && deep) return launch_pdl(deep_kernel<1, SWIGLU>(), grid, block, 0, pdl, st, p);
  if (mt == 2 && deep) return launch_pdl(deep_kernel<2, SWIGLU>(), grid, block, 0, pdl, st, p);
  if (mt == 1) return launch_pdl(tile_kernel<1, SWIGLU>(), grid, block, 0, pdl, st, p);
  if (mt == 2) return launch_pdl(tile_kernel<2, SWIGLU>(), grid, block, 0, pdl, st, p);
  if (mt <= 4) return launch_pdl(tile_kernel<4, SWIGLU>(), grid, block, 0, pdl, st, p);
  if (mt <= 8) return launch_pdl(tile_kernel<8, SWIGLU>(), grid, block, 0, pdl, st, p);
  return cudaErrorInvalidValue;
}

template <int MT>
cudaError_t launch(const Params& p, int groups, bool pdl, cudaStream_t stream) {
  const size_t smem = (size_t)8 * MT * (p.units_per_split * kUnit + kPad) * sizeof(__nv_bfloat16);
  return launch_pdl(linear_smallm_kernel<MT>, dim3((p.N + kRows - 1) / kRows, p.S, groups), dim3(kThreads), smem,
                    pdl, stream, p);
}

}  // namespace

// Largest staged-x footprint the front door may ask for: 48 KB needs no opt-in on any arch.
K26_EXPORT int k26_linear_smallm_max_smem() { return 48 * 1024; }

K26_EXPORT int k26_linear_smallm_rows_per_block() { return kRows; }

// Returns a cudaError_t (or cudaErrorInvalidValue for an M the kernel does not serve). Shapes, strides and
// alignment are validated by the Python front door (k26/ops/linear_cuda.py).
K26_EXPORT int k26_linear_smallm(const void* x, const void* w, const void* residual, void* y, void* partial,
                                 void* counters, int M, int N, int K, int G, long long x_ld, long long x_gs,
                                 long long w_ld, long long w_gs, long long y_ld, long long y_gs, int S,
                                 int units_per_split, int pdl, void* stream) {
  Params p;
  p.x = static_cast<const __nv_bfloat16*>(x), p.w = static_cast<const __nv_bfloat16*>(w);
  p.residual = static_cast<const __nv_bfloat16*>(residual), p.y = static_cast<__nv_bfloat16*>(y);
  p.partial = static_cast<float*>(partial), p.counters = static_cast<int*>(counters);
  p.x_ld = x_ld, p.x_gs = x_gs, p.w_ld = w_ld, p.w_gs = w_gs, p.y_ld = y_ld, p.y_gs = y_gs;
  p.M = M, p.N = N, p.K = K, p.S = S, p.units_per_split = units_per_split;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int mt = (M + 7) / 8;
  if (S == 0) return (int)launch_tile<false>(p, dim3((N + 15) / 16, 1, G), pdl != 0, st);  // tile mode
  if (mt == 1) return (int)launch<1>(p, G, pdl, st);
  if (mt == 2) return (int)launch<2>(p, G, pdl, st);
  if (mt <= 4) return (int)launch<4>(p, G, pdl, st);
  if (mt <= 8) return (int)launch<8>(p, G, pdl, st);
  return (int)cudaErrorInvalidValue;
}

// y[m, n] = swiglu(x[m] . w[n], x[m] . w[I + n]) for n < I: the stacked [gate; up] weight [2 I, K] (rows w_ld
// apart) in tile mode, 8 output features a block (linear_swiglu_kernel). Shapes, strides and alignment are
// validated by the Python front door (k26/ops/swiglu_cuda.py).
K26_EXPORT int k26_linear_swiglu(const void* x, const void* w, void* y, int M, int I, int K, long long x_ld,
                                 long long w_ld, long long y_ld, int pdl, void* stream) {
  Params p{};
  p.x = static_cast<const __nv_bfloat16*>(x), p.w = static_cast<const __nv_bfloat16*>(w);
  p.y = static_cast<__nv_bfloat16*>(y);
  p.x_ld = x_ld, p.w_ld = w_ld, p.y_ld = y_ld;
  p.M = M, p.N = I, p.K = K, p.up = I;
  return (int)launch_tile<true>(p, dim3((I + 7) / 8, 1, 1), pdl != 0, static_cast<cudaStream_t>(stream));
}
