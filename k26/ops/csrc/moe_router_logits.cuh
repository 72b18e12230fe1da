// Phase 1 of the fused MoE router: the kernel's arguments and the logits x · Wᵀ as per-(k range, token, expert)
// fp32 partials — the 'swap AB' mma.sync tiles (16 W rows x 8·NT tokens a warp) and the block's reduction in warp
// order (deterministic). csrc/moe_router.cu includes this inside its namespace; not a standalone header: it uses
// router_select's kThreads / kWarps, moe_router.cu's TRACE and csrc/pdl.cuh. What the phase does and why: the
// header of csrc/moe_router.cu.
//
// Legality: mma.sync.m16n8k16 bf16 and 16-byte global loads: sm_90a and sm_120a.

#pragma once

__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

struct Args {
  const __nv_bfloat16* x;  // [M, D]
  const __nv_bfloat16* w;  // [E, D]
  const float* bias;       // [E]
  int* barrier;  // [5], zero on entry and exit: grid barrier (2; [1]: gate/up tickets at one token), phase-2
                 // arrivals (1), ids flag, departures (csrc/moe_router_gate_up.cuh)
  float* partial;          // [KS, M, E]
  float* out_w;            // [M, K]
  int64_t* out_ids;        // [M, K]
  int* table;              // the expert op's routing table (csrc/moe_route.cuh), or null: not built here
  int M, D, E, n_group, topk_group, topk, renormalize, ks, chunks_per_ks;
  int table_gt, table_S;   // the table's group size (8 nt) and shared-expert slots (M or 0)
  float scale;
};

// Phase 1, one warp: 16 W rows x (8·NT tokens) over chunks [c0, c1) of 64 k. kRelease: dependents released
// right after the grid-dependency wait (router_kernel); the one-token gate/up kernel releases them later.
template <int NT, bool kRelease = true>
__device__ void dot_tile(const Args& a, int m0, int r0, int c0, int c1, float acc[NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint4* wr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + g + 8 * h;
    wr[h] = row < a.E ? reinterpret_cast<const uint4*>(a.w + (size_t)row * a.D) + 2 * t : nullptr;
  }
  const uint4* xr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = m0 + nt * 8 + g;
    xr[nt] = tok < a.M ? reinterpret_cast<const uint4*>(a.x + (size_t)tok * a.D) + 2 * t : nullptr;
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
  constexpr int U = NT == 1 ? 4 : NT == 2 ? 2 : 1;  // chunks of W in flight per warp
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c = c0; c < c1; c += U) {
    uint4 wv[U][2][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q)
          wv[u][h][q] = (c + u < c1 && wr[h]) ? __ldcs(wr[h] + (size_t)(c + u) * 8 + q) : zero;  // streamed once
    // PDL: the first weight batch (a constant) is in flight while the kernel before us finishes; x is its output.
    // Dependents are released only after this wait (router_kernel says why).
    if (c == c0) {
      pdl_wait();
      if (kRelease) pdl_trigger();
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c + u >= c1) break;
      uint4 xv[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int q = 0; q < 2; ++q)  // x, the previous kernel's output: coherent (pdl.cuh)
          xv[nt][q] = xr[nt] ? __ldcg(xr[nt] + (size_t)(c + u) * 8 + q) : zero;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = j >> 1, i0 = 2 * (j & 1);
        const uint32_t a0 = word(wv[u][0][q], i0), a2 = word(wv[u][0][q], i0 + 1);
        const uint32_t a1 = word(wv[u][1][q], i0), a3 = word(wv[u][1][q], i0 + 1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[nt], a0, a1, a2, a3, word(xv[nt][q], i0), word(xv[nt][q], i0 + 1));
      }
    }
  }
}

template <int NT, bool kRelease = true>
__device__ void logits_phase(const Args& a, float (*red)[NT * 4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_tiles = (a.E + 15) / 16, m_tiles = (a.M + 8 * NT - 1) / (8 * NT);
  const int kc = a.D / 64, items = m_tiles * row_tiles * a.ks;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int rt = item % row_tiles, ks = (item / row_tiles) % a.ks, mt = item / (row_tiles * a.ks);
    const int cb = ks * a.chunks_per_ks, ce = min(kc, cb + a.chunks_per_ks), n = ce - cb;
    float acc[NT][4];
    dot_tile<NT, kRelease>(a, mt * 8 * NT, rt * 16, cb + warp * n / kWarps, cb + (warp + 1) * n / kWarps, acc);
    TRACE(1);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][nt * 4 + i][lane] = acc[nt][i];
    __syncthreads();
    for (int v = threadIdx.x; v < NT * 4 * 32; v += kThreads) {
      const int l = v & 31, i = (v >> 5) & 3, nt = v >> 7;
      const int row = rt * 16 + (l >> 2) + 8 * (i >> 1);
      const int tok = mt * 8 * NT + nt * 8 + 2 * (l & 3) + (i & 1);
      if (row >= a.E || tok >= a.M) continue;
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[w][nt * 4 + i][l];  // fixed order: deterministic
      a.partial[((size_t)ks * a.M + tok) * a.E + row] = s;
    }
    __syncthreads();
  }
}
