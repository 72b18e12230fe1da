// MLA's glue and the q_b projection in one launch: torch.ops.k26.mla_glue_qb (k26/ops/glue_qb_cuda.py), the same
// bits as mla_glue (csrc/mla_glue.cu) followed by the small-M linear's tile mode (csrc/linear_smallm.cu):
//
//   q_b = q_a_layernorm(q_a) @ W_qb^T                               (bf16 rounding points as the two ops)
//   cache[rows[b], prefix[b] + n] = [kv_a_layernorm(kv_a[t, :R]), rope(kv_a[t, R:])]   (as mla_glue)
//
// Why: the glue is one small block per token between two projections; as its own launch it costs the step a
// kernel boundary (its completion, the q_b blocks' grid-dependency wait, a round trip of q through L2) for
// ~1 µs of work. Here the grid is the q_b projection's 16-row tile blocks plus one block per token for the kv
// half (k26_glue::glue_token<false>): no block waits for another. Each tile block forms the q norm's
// per-row scale itself, with mla_glue's thread mapping, fma order, shuffle tree and warp order (so the same
// bits), and normalises x's fragments as they reach the mma (NormedX: bf16(w * bf16(x * rs)), mla_glue's
// rounding points), so the projection sees exactly the q mla_glue would have written.
// Served up to 16 tokens (two token tiles) in one wave (the front door checks): the deep tile variant, four
// units a batch, one block per SM.
//
// Legality: as linear_smallm.cu and mla_glue.cu (mma.sync, plain loads, shuffles, griddepcontrol; < 48 KB
// static shared memory). Built for sm_90a and sm_120a. Speed: profiling/bench_k26.py --glue-qb (the step A/B).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "linear_tile.cuh"
#include "mla_glue_row.cuh"
#include "pdl.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using namespace k26_linear;

constexpr int kMaxTiles = 2;  // token tiles of 8: up to 16 tokens
static_assert(kTileThreads == k26_glue::kThreads, "the glue's thread mapping is the tile block's");

struct GlueQb {
  k26_glue::GlueParams g;  // q = q_a, kv = kv_a, the norms, RoPE and the cache; q_out unused
  Params lin;              // x = q_a, w = W_qb, y = q_b: M rows, N = H * qk_head_dim, K = Q
  int tile_blocks;         // blocks of the projection; the T blocks after them run the kv halves
};

// x's fragments normalised as they reach the mma: unit u's 16 bytes of row 8j + g at k = 32u + 8t (PlainX's
// fragment) become bf16(w[k] * bf16(x * rs[j])), the glue's q output; rows past M stay zero.
template <int MT, int B>
struct NormedX {
  struct Batch {
    typename PlainX<MT, B>::Batch px;  // q_a's fragments, normalised in place by compute
    uint4 w[B];                        // the norm weight's 8 values at each fragment's k
  };
  PlainX<MT, B> plain;
  const __nv_bfloat16* q_w;
  float rs[MT];
  __device__ __forceinline__ void load(Batch& b, int u) const {
    plain.load(b.px, u);
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int k = (u + i) * kUnit + plain.kt;
      b.w[i] = u + i < plain.u_end && k < plain.K ? __ldg(reinterpret_cast<const uint4*>(q_w + k)) : make_uint4(0, 0, 0, 0);
    }
  }
  __device__ __forceinline__ void compute(float (&acc)[MT][4], const uint4 (&w)[B][2], Batch& b, int u) const {
#pragma unroll
    for (int i = 0; i < B; ++i)
#pragma unroll
      for (int j = 0; j < MT; ++j)
        if (j < plain.tiles_live) {
          float f[8];
          k26_glue::unpack(b.px.x[i][j], f);
          b.px.x[i][j] = k26_glue::normed(f, b.w[i], rs[j]);
        }
    plain.compute(acc, w, b.px, u);
  }
};

// Per token row m < M of q_a: rs[m] = rsqrt(mean(q_a[m]^2) + eps) exactly as mla_glue forms it (thread c holds
// chunk c, c + 256, ... below Q / 8; fma chain, xor-shuffle tree, warps summed in order), into rs_out[m]. Rows
// go kRowBatch at a time with all their chunk loads issued first (one L2 round trip a batch, not a row).
constexpr int kRowBatch = 4;
__device__ __forceinline__ void q_row_scales(const k26_glue::GlueParams& g, int M, float (*part)[8 * kMaxTiles],
                                             float* rs_out) {
  constexpr int C = k26_glue::kMaxChunks;
  const int qc = g.Q / 8, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int m0 = 0; m0 < M; m0 += kRowBatch) {
    uint4 v[kRowBatch][C];
#pragma unroll
    for (int r = 0; r < kRowBatch; ++r)
#pragma unroll
      for (int i = 0; i < C; ++i) {
        const int c = threadIdx.x + i * k26_glue::kThreads;
        v[r][i] = m0 + r < M && c < qc ? *reinterpret_cast<const uint4*>(g.q + (m0 + r) * g.q_ld + 8 * c)
                                       : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int r = 0; r < kRowBatch; ++r) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < C; ++i) {
        if (threadIdx.x + i * k26_glue::kThreads >= qc) continue;
        float x[8];
        k26_glue::unpack(v[r][i], x);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = __fmaf_rn(x[j], x[j], s);
        ss += s;
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0 && m0 + r < M) part[warp][m0 + r] = ss;
    }
  }
  __syncthreads();
  if (threadIdx.x < M) {
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < k26_glue::kWarps; ++i) tot += part[i][threadIdx.x];
    rs_out[threadIdx.x] = rsqrtf(__fadd_rn(__fmul_rn(tot, 1.f / (float)g.Q), g.eps));
  }
  __syncthreads();
}

template <int MT, int B>
__global__ void __launch_bounds__(kTileThreads, 1) mla_glue_qb_kernel(const GlueQb a) {
  if (blockIdx.x >= a.tile_blocks) {  // the kv half of token blockIdx.x - tile_blocks (waits, then triggers)
    k26_glue::glue_token<false>(a.g, blockIdx.x - a.tile_blocks);
    return;
  }
  __shared__ float red[kTileWarps][MT * 4][32];
  __shared__ float part[k26_glue::kWarps][8 * kMaxTiles];
  __shared__ float rs_sm[8 * kMaxTiles];
  const Params& p = a.lin;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, kt = 8 * t;
  const int n_tile = blockIdx.x * 16;
  const int units = (p.K + kUnit - 1) / kUnit;
  const int u_begin = warp * units / kTileWarps, u_end = (warp + 1) * units / kTileWarps;
  const __nv_bfloat16* w_lo = p.w + (long long)min(n_tile + g, p.N - 1) * p.w_ld;  // clamped rows are discarded
  const __nv_bfloat16* w_hi = p.w + (long long)min(n_tile + g + 8, p.N - 1) * p.w_ld;
  const int tiles_live = (p.M - g + 7) / 8;  // j with 8j + g < M

  uint4 wa[B][2], wb[B][2];
  load_batch(wa, w_lo, w_hi, u_begin, u_end, kt, p.K);  // two weight batches in flight across the wait
  load_batch(wb, w_lo, w_hi, u_begin + B, u_end, kt, p.K);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // q_a / kv_a come from the projection just before
#endif
  q_row_scales(a.g, p.M, part, rs_sm);
  NormedX<MT, B> xs{{p.x + g * p.x_ld + kt, 8 * p.x_ld, tiles_live, u_end, kt, p.K}, a.g.q_w, {}};
#pragma unroll
  for (int j = 0; j < MT; ++j) xs.rs[j] = 8 * j + g < p.M ? rs_sm[8 * j + g] : 0.f;
  float acc[MT][4] = {};
  tile_loop<MT, B>(acc, wa, wb, xs, w_lo, w_hi, u_begin, u_end, kt, p.K);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();  // the next kernel may start streaming its weights
#endif
  tile_store<MT>(acc, red, p, 0, n_tile);
}

}  // namespace

K26_EXPORT int k26_mla_glue_qb_max_tokens() { return 8 * kMaxTiles; }

// Returns a cudaError_t. The Python front door (k26/ops/glue_qb_cuda.py) validates shapes, strides, dtypes and
// alignment (as for mla_glue and linear) and serves T <= 16 tokens, q_a rows contiguous (q_ld = Q) or not.
K26_EXPORT int k26_mla_glue_qb(const void* q, const void* kv, const void* q_w, const void* kv_w, const void* pos,
                               const void* inv_freq, const void* rows, const void* prefix, void* cache,
                               const void* w_qb, void* q_b, long long q_ld, long long kv_ld, long long c_row,
                               long long c_tok, int T, int N, int Q, int R, int P, int NQ, float eps, int pdl,
                               void* stream) {
  if (T < 1 || T > 8 * kMaxTiles || Q % 8 || R % 8 || Q + R > 8 * k26_glue::kMaxChunks * k26_glue::kThreads ||
      P % 2 || P / 2 > k26_glue::kThreads || NQ < 1)
    return (int)cudaErrorInvalidValue;
  GlueQb a = {};
  k26_glue::GlueParams& g = a.g;
  g.q = static_cast<const __nv_bfloat16*>(q), g.kv = static_cast<const __nv_bfloat16*>(kv);
  g.q_w = static_cast<const __nv_bfloat16*>(q_w), g.kv_w = static_cast<const __nv_bfloat16*>(kv_w);
  g.pos = static_cast<const long long*>(pos), g.inv_freq = static_cast<const float*>(inv_freq);
  g.rows = static_cast<const long long*>(rows), g.prefix = static_cast<const long long*>(prefix);
  g.q_out = nullptr, g.cache = static_cast<__nv_bfloat16*>(cache);
  g.q_ld = q_ld, g.kv_ld = kv_ld, g.c_row = c_row, g.c_tok = c_tok;
  g.N = N, g.Q = Q, g.R = R, g.P = P, g.eps = eps;
  Params& p = a.lin;
  p = Params{};
  p.x = g.q, p.w = static_cast<const __nv_bfloat16*>(w_qb), p.residual = nullptr;
  p.y = static_cast<__nv_bfloat16*>(q_b);
  p.x_ld = q_ld, p.w_ld = Q, p.y_ld = NQ;
  p.M = T, p.N = NQ, p.K = Q, p.S = 0, p.units_per_split = 0;
  a.tile_blocks = (NQ + 15) / 16;
  const dim3 grid(a.tile_blocks + T), block(kTileThreads);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (T <= 8) return (int)launch_pdl(mla_glue_qb_kernel<1, 4>, grid, block, 0, pdl != 0, st, a);
  return (int)launch_pdl(mla_glue_qb_kernel<2, 4>, grid, block, 0, pdl != 0, st, a);
}
