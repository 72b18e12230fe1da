// MLA glue fused with the q_b projection, one launch (torch.ops.k26.mla_glue_linear, k26/ops/glue_cuda.py):
//   y[t]                          = q_a_layernorm(q_a[t]) @ W_qb^T
//   cache[rows[b], prefix[b] + n] = [ kv_a_layernorm(kv_a[t, :R]),  rope(kv_a[t, R:], positions[t]) ]
// what csrc/mla_glue.cu then the small-M linear's tile mode (csrc/linear_smallm.cu) compute, one kernel fewer
// on the decode layer's chain (ARCHITECTURE.md, "The decode layer as a kernel budget").
//
// grid.x = the projection's 16-row tiles of W, then one block per token:
// - a tile block streams its W rows (two register batches issued before the grid-dependency wait, as tile
//   mode), then normalises every token's q_a row into shared memory with the glue's own arithmetic and
//   reduction order (glue_q_rows: the same bits as the glue kernel's output) and runs tile mode's loop on
//   those rows (x from shared memory instead of L1 / L2) and its warp-order store: the same bits as the two
//   kernels, so the fused and the unfused model agree bit for bit;
// - a token block runs the glue's kv half (glue_token with Q = 0: norm, RoPE, the cache write). Its chunks sit
//   on threads 0 .. R / 8 - 1 where the glue kernel puts them after the q chunks: the same lanes of their warps,
//   so the same bits, when Q / 8 is a multiple of 32 and Q / 8 + R / 8 <= 256 (K2.6: 192 + 64; tested there).
// Each tile block normalises all M <= 16 rows itself (3 KB a row from L2, 96 blocks at K2.6's TP8 shape):
// no grid-wide dependency, so one launch. More rows are the front door's two launches (glue, then linear).
//
// Legality: mma.sync.m16n8k16 bf16, ld.global.nc, cp.async, shuffles, griddepcontrol; <= 50 KB dynamic + 9 KB static
// shared memory per block at K2's Q = 1536 (the front door bounds Q to fit 99 KB): sm_90a and sm_120a.
// Benchmark: profiling/bench_k26.py (the step's per-kernel table).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "linear_tile.cuh"
#include "mla_glue_row.cuh"
#include "pdl.cuh"
#include "smem_optin.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using k26_glue::GlueParams;
using namespace k26_linear;

constexpr int kPad = 32;  // bf16 elements of padding a staged row (64 B): a 16-byte phase's 2 rows x 4 lanes on
                          // distinct banks (K2.6: Q + 32 = 1568, not a multiple of 64)
// Dynamic shared memory the kernel is opted into, once per device, whatever the launch's Q: the front door admits
// only launches within it (16 rows of Q + kPad), and the 9 KB of static shared memory beside it stay under
// sm_120's 101,376 B. (Opting in to each launch's own size would keep the first size: smem_opt_in runs once.)
constexpr int kMaxDynamicSmem = 88 * 1024;

struct GlueLinearParams {
  GlueParams glue;  // q = the raw q_a rows; q_out unused (the normed rows stay in shared memory)
  Params lin;       // w, y, M = tokens, N, K = Q, y_ld, w_ld; x unused
  int tiles, ldx;
};

template <int MT, int B, int MINB>
__global__ void __launch_bounds__(kTileThreads, MINB) mla_glue_linear_kernel(const GlueLinearParams p) {
  static_assert(kTileThreads == k26_glue::kThreads, "the glue's block is the tile block");
  if (blockIdx.x >= p.tiles) {  // a token's kv half
    GlueParams g = p.glue;
    g.Q = 0;
    k26_glue::glue_token(g, blockIdx.x - p.tiles);
    return;
  }
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);  // [8 MT][ldx]: the normed q rows
  __shared__ float red[kTileWarps][MT * 4][32];
  const Params& l = p.lin;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, kt = 8 * t;
  const int n_tile = blockIdx.x * 16;
  const int units = (l.K + kUnit - 1) / kUnit;
  const int u_begin = warp * units / kTileWarps, u_end = (warp + 1) * units / kTileWarps;
  const __nv_bfloat16* w_lo = l.w + (long long)min(n_tile + g, l.N - 1) * l.w_ld;  // clamped rows are discarded
  const __nv_bfloat16* w_hi = l.w + (long long)min(n_tile + g + 8, l.N - 1) * l.w_ld;

  uint4 wa[B][2], wb[B][2], qw[k26_glue::kMaxChunks];
  load_batch(wa, w_lo, w_hi, u_begin, u_end, kt, l.K);  // weights never come from the previous kernel
  load_batch(wb, w_lo, w_hi, u_begin + B, u_end, kt, l.K);
  k26_glue::load_q_weight(p.glue, qw);
  pdl_wait();  // q_a / kv_a come from the projection just before
  k26_glue::glue_q_rows<8 * MT>(p.glue, 0, l.M, qw, xs, p.ldx);
  float acc[MT][4] = {};
  const int tiles_live = (l.M - g + 7) / 8;  // j with 8j + g < M
  tile_loop<MT, B, true>(acc, wa, wb, w_lo, w_hi, xs + g * p.ldx + kt, 8 * p.ldx, tiles_live, u_begin, u_end, kt,
                         l.K);
  pdl_trigger();  // the next kernel may start streaming its weights
  tile_store<MT>(acc, red, l, 0, n_tile);
}

template <int MT, int B, int MINB>
cudaError_t launch(const GlueLinearParams& p, int T, bool pdl, cudaStream_t st) {
  constexpr auto kernel = mla_glue_linear_kernel<MT, B, MINB>;
  const size_t smem = (size_t)8 * MT * p.ldx * sizeof(__nv_bfloat16);
  if (smem > kMaxDynamicSmem) return cudaErrorInvalidValue;
  // Always: the default 48 KB counts the kernel's static shared memory too.
  if (const cudaError_t e = smem_opt_in<kernel>(kMaxDynamicSmem); e != cudaSuccess) return e;
  return launch_pdl(kernel, dim3(p.tiles + T), dim3(kTileThreads), smem, pdl, st, p);
}

int sm_count() {  // cudaDeviceGetAttribute reads a cached property: cheap enough for every launch
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

}  // namespace

// Tokens one launch serves; the staged rows' bytes per token for a given Q and the most all rows may take (the
// front door bounds Q with them).
K26_EXPORT int k26_mla_glue_linear_max_tokens() { return k26_glue::kMaxRows; }
K26_EXPORT int k26_mla_glue_linear_row_bytes(int Q) { return (Q + kPad) * (int)sizeof(__nv_bfloat16); }
K26_EXPORT int k26_mla_glue_linear_max_smem() { return kMaxDynamicSmem; }

// Returns a cudaError_t (cudaErrorInvalidValue for more tokens than one launch serves). Shapes, strides,
// dtypes and alignment are validated by the Python front door (k26/ops/glue_cuda.py).
K26_EXPORT int k26_mla_glue_linear(const void* q, const void* kv, const void* q_w, const void* kv_w, const void* pos,
                                   const void* inv_freq, const void* rows, const void* prefix, void* cache,
                                   const void* w, void* y, long long q_ld, long long kv_ld, long long c_row,
                                   long long c_tok, long long w_ld, int T, int N, int Q, int R, int P, int n_out,
                                   float eps, int pdl, void* stream) {
  if (T < 1 || T > k26_glue::kMaxRows) return (int)cudaErrorInvalidValue;
  GlueLinearParams p = {};
  GlueParams& g = p.glue;
  g.q = static_cast<const __nv_bfloat16*>(q), g.kv = static_cast<const __nv_bfloat16*>(kv);
  g.q_w = static_cast<const __nv_bfloat16*>(q_w), g.kv_w = static_cast<const __nv_bfloat16*>(kv_w);
  g.pos = static_cast<const long long*>(pos), g.inv_freq = static_cast<const float*>(inv_freq);
  g.rows = static_cast<const long long*>(rows), g.prefix = static_cast<const long long*>(prefix);
  g.cache = static_cast<__nv_bfloat16*>(cache);
  g.q_ld = q_ld, g.kv_ld = kv_ld, g.c_row = c_row, g.c_tok = c_tok;
  g.N = N, g.Q = Q, g.R = R, g.P = P, g.eps = eps;
  Params& l = p.lin;
  l.w = static_cast<const __nv_bfloat16*>(w), l.y = static_cast<__nv_bfloat16*>(y);
  l.w_ld = w_ld, l.y_ld = n_out;
  l.M = T, l.N = n_out, l.K = Q;
  p.tiles = (n_out + 15) / 16, p.ldx = Q + kPad;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  // One block per SM at most: the deep batch, as tile mode (csrc/linear_tile.cuh, tile_batch).
  const bool deep = p.tiles + T <= sm_count(), on = pdl != 0;
  if (T <= 8)
    return (int)(deep ? launch<1, kDeepBatch, 1>(p, T, on, st) : launch<1, tile_batch<1>(), 1>(p, T, on, st));
  return (int)(deep ? launch<2, kDeepBatch, 1>(p, T, on, st) : launch<2, tile_batch<2>(), 1>(p, T, on, st));
}
