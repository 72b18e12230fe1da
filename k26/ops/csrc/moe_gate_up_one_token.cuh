// The one-token gate/up rows of one routed expert (gated_one_token), shared by the expert op's gate/up GEMM
// (csrc/moe_gemm.cuh) and the one-token router + gate/up kernel (csrc/moe_router_gate_up.cuh). Device code only
// (no kernels), so the router's translation unit can include it without compiling the expert op's kernels.
//
// Legality: mma.sync, ld.global (streaming), prefetch, cp.async: sm_90a and sm_120a.

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "moe_mma.cuh"

#ifndef MOE_TRACE  // phase stamps: csrc/moe_w4a16.cu defines it (-DK26_MOE_TRACE)
#define MOE_TRACE(table, k)
#endif

namespace k26_moe {

// Gate/up rows of one routed expert for a group of ONE token (decode), x's row staged in shared memory:
// B fragments come from there (lanes g = 0 hold the token, others zero), so a chunk in flight costs a
// lane 5 registers instead of 13 and kOneTokU chunks stay in flight (the register path keeps 4: its
// 14-chunk k range per warp at K2.6 took 4 round trips, this takes 2). Measured (run 7): the TP1 M = 1 block
// 8 % faster, TP8 unchanged (its gate/up is not bound by one warp's round trips). Same fragments, same mma
// order as the register path: bit-identical. All threads of the block call it (it stages x and synchronises).
// (14, all of a warp's K2.6 chunks in one round trip, spills at the 80-register bound and took 14.5 µs for the
// routed loop instead of 9.5: 2026-12-01-moe_trace-h200.md.) Also dropped: every chunk of the warp in flight
// through a cp.async ring in 56 KB of dynamic shared memory, each multiplied as it lands — the block at one
// token 25.3 -> 31.3 µs, the decode step 4.41 -> 5.36 ms (H100, 2026-12-05-moe-gate-up-probe-session26-h100.md:
// the read probe there shows the dequant + mma, ~90 instructions a chunk, is what the walk fails to hide,
// not the loads in flight).
constexpr int kOneTokU = 8;
constexpr int kOneTokMaxK = 7168;  // the staged row's capacity (bf16): K2.6's hidden size

__device__ __forceinline__ void gated_one_token(const uint4* __restrict__ w, const uint32_t* __restrict__ s,
                                                const __nv_bfloat16* __restrict__ xrow, int K, size_t tile_base,
                                                int c_begin, int c_end, uint4* xs, float acc[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint4 wv[kOneTokU];
  uint32_t sv[kOneTokU];
  auto load = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kOneTokU; ++u) {
      const size_t chunk = tile_base + c0 + u;
      if (c0 + u < c_end) {
        wv[u] = ld_weight(w + chunk * 32 + lane);  // streamed once
        sv[u] = __ldg(s + chunk * 16 + 2 * g + (t >> 1));
      }
    }
  };
  load(c_begin);  // the first weight batch is in flight while x is staged
#ifdef K26_MOE_GU_L2AHEAD
  // The rest of the warp's k range (K2.6 TP8: chunks 8-13, 3.4 KB) requested into L2 now, behind the first
  // batch: the whole tile is in the DRAM queue at once and the second batch's loads (issued after the first
  // is multiplied) hit L2 instead of a second loaded DRAM round trip. No registers, same loads, same bits.
  for (int c = c_begin + kOneTokU; c < c_end; ++c) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(w + (tile_base + c) * 32 + lane));
    if (lane == 0) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(s + (tile_base + c) * 16));
  }
#endif
  const uint4* x4 = reinterpret_cast<const uint4*>(xrow);
  // x staged by cp.async.cg (through L2, coherent as __ldcg: pdl.cuh), a thread's 3-4 copies issued back to
  // back. A load-then-store loop (`xs[i] = __ldcg(x4 + i)`, before 2026-12-06) compiles to LDG, STS, branch:
  // each iteration's store waits out its L2 round trip before the next load issues, so 4 dependent round
  // trips, under the weight stream's load, came before the block barrier and the first multiply (SASS,
  // 2026-12-05). Same bytes in shared memory: bit-identical. Measured (H100, bench_moe --block, TP8 shapes,
  // three rounds): the block at one token 25.1 -> 24.4 µs uniform, 26.5 -> 26.2 skewed
  // (2026-12-06-moe-variants-session28-h100.md).
  // A fixed, unrolled count of copies (4 a thread at 256 threads): with a runtime loop ptxas sank up to six of
  // the first batch's eight weight loads below the copies, some below the wait (SASS, 2026-12-05); the tail
  // loop serves narrower blocks (none today: both callers run 256 threads).
  auto copy_x = [&](int i) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(xs + i));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(x4 + i) : "memory");
  };
  constexpr int kXCopies = (kOneTokMaxK / 8 + 255) / 256;
#pragma unroll
  for (int j = 0; j < kXCopies; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i >= K / 8) break;
    copy_x(i);
  }
  for (int i = threadIdx.x + kXCopies * blockDim.x; i < K / 8; i += blockDim.x) copy_x(i);
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c0 = c_begin; c0 < c_end; c0 += kOneTokU) {
    if (c0 != c_begin) load(c0);
#pragma unroll
    for (int u = 0; u < kOneTokU; ++u) {
      if (c0 + u >= c_end) break;
      const uint4 b[2] = {g == 0 ? xs[(c0 + u) * 8 + 2 * t] : zero, g == 0 ? xs[(c0 + u) * 8 + 2 * t + 1] : zero};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t word = j == 0 ? wv[u].x : j == 1 ? wv[u].y : j == 2 ? wv[u].z : wv[u].w;
        uint32_t a[4];
        dequant(word, sv[u], a);
        const uint4 bb = b[j >> 1];
        mma_bf16(acc, a, (j & 1) ? bb.z : bb.x, (j & 1) ? bb.w : bb.y);
      }
    }
    if (c0 == c_begin) MOE_TRACE(0, 4);  // warp 0's first weight batch arrived and multiplied
  }
}

}  // namespace k26_moe
