// -DK26_LINEAR_TILE_RT=R: tile-mode blocks of R 16-row tiles of W for grids wider than one wave (csrc/linear_smallm.cu
// includes this under the switch; a prepared variant, see the VARIANTS entry in k26/ops/build.py). Not a
// standalone header: it uses linear_smallm.cu's namespace and tile mode's pieces (csrc/linear_tile.cuh).
//
// Why: o_proj at a TP8 rank (7,168 x 1,024) is 448 tiles; at two blocks an SM (264 slots on an H200) the second
// wave's weight loads start only when first-wave blocks retire, two DRAM round trips in series (tile mode 6.75 µs
// at M = 1 against a 4.66 µs floor and cuBLAS's 6.08: 2026-12-01-bench_linear-h200-tile.md). With R = 2 the 224
// blocks fit one wave and every tile's weights are in flight across the grid-dependency wait. Each warp still
// runs its own k range of each tile unit by unit: a row's sums, and so its bits, do not depend on R (tile mode
// stays batch-invariant). Not measured yet.
//
// Served at <= 8 tokens (MT 1): at MT 2 two blocks an SM spill. Legality: as tile mode (mma.sync.m16n8k16 bf16,
// ld.global.nc, shared memory for the warps' sums): sm_90a and sm_120a; R x 4 KB of static shared memory.

#pragma once

template <int MT, int B, int MINB, int RT>
__global__ void __launch_bounds__(kTileThreads, MINB) linear_tile_rt_kernel(const Params p) {
  __shared__ float red[kTileWarps][RT * MT * 4][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, kt = 8 * t;
  const int grp = blockIdx.z, n_tile = blockIdx.x * 16 * RT;
  const int units = (p.K + kUnit - 1) / kUnit;
  const int u_begin = warp * units / kTileWarps, u_end = (warp + 1) * units / kTileWarps;
  const __nv_bfloat16* wg = p.w + grp * p.w_gs;
  const __nv_bfloat16 *w_lo[RT], *w_hi[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {  // clamped rows are discarded
    w_lo[r] = wg + (long long)min(n_tile + 16 * r + g, p.N - 1) * p.w_ld;
    w_hi[r] = wg + (long long)min(n_tile + 16 * r + g + 8, p.N - 1) * p.w_ld;
  }
  const __nv_bfloat16* xr = p.x + grp * p.x_gs + g * p.x_ld + kt;
  const int tiles_live = (p.M - g + 7) / 8;  // j with 8j + g < M
  uint4 wa[RT][B][2], wb[RT][B][2];
#pragma unroll
  for (int r = 0; r < RT; ++r) {  // two weight batches of every tile in flight across the wait
    load_batch(wa[r], w_lo[r], w_hi[r], u_begin, u_end, kt, p.K);
    load_batch(wb[r], w_lo[r], w_hi[r], u_begin + B, u_end, kt, p.K);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // x and residual may come from the previous kernel
#endif
  float acc[RT][MT][4] = {};
#pragma unroll
  for (int r = 0; r < RT; ++r)
    tile_loop<MT, B>(acc[r], wa[r], wb[r], w_lo[r], w_hi[r], xr, 8 * p.x_ld, tiles_live, u_begin, u_end, kt, p.K);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();  // the next kernel may start streaming its weights
#endif
  // The warps' sums in warp order, as tile_store (deterministic; the reference's rounding), tile by tile.
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][(r * MT + j) * 4 + c][lane] = acc[r][j][c];
  __syncthreads();
  if (warp != 0) return;
  const __nv_bfloat16* res = p.residual ? p.residual + grp * p.y_gs : nullptr;
  __nv_bfloat16* yg = p.y + grp * p.y_gs;
#pragma unroll 1
  for (int rj = 0; rj < RT * MT; ++rj)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float v = 0.f;
#pragma unroll
      for (int q = 0; q < kTileWarps; ++q) v += red[q][rj * 4 + c][lane];
      const int n = n_tile + 16 * (rj / MT) + g + 8 * (c / 2), m = 8 * (rj % MT) + 2 * t + c % 2;
      if (n < p.N && m < p.M) yg[m * p.y_ld + n] = finish(v, res, m * p.y_ld + n);
    }
}

// Tile mode's launch for a grid wider than one wave: R tiles a block, MT token tiles at tile mode's batch and
// occupancy.
template <int MT>
cudaError_t launch_tile_rt(const Params& p, int N, int G, bool pdl, cudaStream_t st) {
  constexpr int R = K26_LINEAR_TILE_RT;
  const dim3 grid((N + 16 * R - 1) / (16 * R), 1, G);
  return launch_pdl(linear_tile_rt_kernel<MT, tile_batch<MT>(), tile_blocks<MT>(), R>, grid, dim3(kTileThreads), 0,
                    pdl, st, p);
}
