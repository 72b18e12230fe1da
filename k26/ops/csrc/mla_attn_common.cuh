// Shared pieces of the MLA tree-attention kernel (csrc/mla_tree_attn.cu, csrc/mla_attn_merge.cuh): tile
// geometry and shared-memory layout (Cfg), the launch parameters, cp.async / ldmatrix / mma.sync wrappers, the
// split geometry every block of a sequence agrees on, and the -DK26_ATTN_TRACE phase stamps.
//
// Legality: mma.sync.m16n8k16 bf16, ldmatrix, cp.async (sm_80+): sm_90a and sm_120a.

#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "globaltimer.cuh"

// Phase timestamps for profiling/debug/attn_trace.py (built with -DK26_ATTN_TRACE; absent otherwise).
#ifdef K26_ATTN_TRACE
__device__ unsigned long long g_attn_trace[1024][16];
#define TRACE(k)                                                                       \
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.z == 0 && blockIdx.y < 1024) \
    g_attn_trace[blockIdx.y][k] = k26_globaltimer();
#else
#define TRACE(k)
#endif

namespace k26_attn {

namespace cg = cooperative_groups;
constexpr int DQK = 576, DV = 512;
constexpr int BN = 16;            // keys per tile
constexpr int NSTAGE = 4;         // cp.async stages of 18.7 KB: three tiles in flight during compute
constexpr int THREADS = 256;      // 8 warps
constexpr int LDS = DQK + 8;      // padded smem row, 1168 B: ldmatrix rows land on distinct banks
constexpr int KQ = 4;             // dim quarters of the S = Q K^T product (144 dims = 9 k-steps each)
constexpr int KSTEPS = DQK / 16 / KQ;
constexpr int LDSS = BN + 4;      // fp32 partial-score row
constexpr int LDP = BN + 8;       // bf16 P row (48 B: 16-B aligned rows for ldmatrix)
constexpr int CHUNK_PER_ROW = DQK / 8;  // 16-byte chunks per cache row

template <int MT>
struct Cfg {
  static constexpr int BM = 16 * MT;
  static constexpr size_t K = (size_t)NSTAGE * BN * LDS * 2;
  static constexpr size_t S = (size_t)KQ * BM * LDSS * 4;
  static constexpr size_t P = (size_t)BM * LDP * 2;
  static constexpr size_t WORDS = (size_t)BM * 4 * 8;  // each row's ancestor words (<= 4: N <= 256)
  static constexpr size_t SMEM = K + S + P + WORDS + 3 * BM * 4;
  static_assert(SMEM <= 101376, "sm_120 allows at most 99 KB of shared memory per block");
  static_assert((size_t)BM * LDS * 2 <= (size_t)MT * BN * LDS * 2, "Q staging must fit MT stages");
  static_assert(S >= (size_t)(32 + 1) * BM * 4, "the merge's weights reuse the score buffer");
};

struct Params {
  const __nv_bfloat16* q;      // [B, N, H, 576], or [B, N, H, 512] with a Rotary query part
  const __nv_bfloat16* cache;  // [cache rows, max_len, 576]
  const int64_t* rows;         // [B]
  const int64_t* prefix;       // [B]
  const int64_t* words;        // [B, N, W]
  __nv_bfloat16* out;          // [B, N, H, 512]
  float* lse;                  // [B, N, H]
  int* counters;               // [B, RT]   zero at rest
  float* lse_part;             // [B, RT, S_max / CL, BM]      one partial per cluster
  float* o_part;               // [B, RT, S_max / CL, BM, 512]
  int N, H, W, R, RT, max_len, S_max, CL, min_keys;
  float scale_log2;  // softmax scale * log2(e): scores live in the exp2 domain
};

// The query's rotary part apart from q (tree_attn_kernel<MT, true>): a second kernel argument, not fields of
// Params, whose local copy the kernel keeps (Params grown by these 32 bytes cost the plain query's kernel
// 4-7 %, bench_tree_attn 2026-12-01).
struct Rotary {
  const __nv_bfloat16* q_pe;  // row (b, n, h) at + ((b N + n) H + h) pe_ld: the rotary dims before RoPE
  const int64_t* positions;   // [B, N]
  const float* inv_freq;      // [32] (interleaved pairs)
  long long pe_ld;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N_>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N_)); }

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x2(uint32_t r[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Split geometry, identical in every block of a sequence: chunk (keys per split, a multiple of BN) and
// the active split count for T = live keys.
__device__ __forceinline__ void split_geometry(const Params& p, int T, int& chunk, int& active) {
  const int want = max(1, min(p.S_max, (T + p.min_keys - 1) / p.min_keys));
  chunk = ((T + want - 1) / want + BN - 1) / BN * BN;
  active = (T + chunk - 1) / chunk;
}

}  // namespace k26_attn
