// MLA glue between the q_a / kv_a projection and the rest of the attention, one launch for every token:
//   q_out[t]                      = q_a_layernorm(q_a[t])
//   cache[rows[b], prefix[b] + n] = [ kv_a_layernorm(kv_a[t, :R]),  rope(kv_a[t, R:], positions[t]) ]
// with t = b * N + n. The pure-torch specification is k26/ops/glue_cuda.py's `mla_glue_reference` (today's
// module composition: RMSNorm in HF precision, interleaved-pair YaRN RoPE, `mla_write_cache`).
//
// One block per token. The token's Q + R normed values are 16-byte chunks spread over the block (K2: 192 q
// chunks + 64 kv chunks = exactly 256 threads), held in registers across the block-wide sums of squares; the
// P / 2 rotary pairs go to the first P / 2 threads. Rounding follows the reference step by step: fp32 sum of
// squares, x * rsqrt(mean + eps) rounded to bf16, times the bf16 weight rounded again; the rotation in fp32
// without FMA contraction (torch's eager x0 * cos - x1 * sin), accurate cosf / sinf of the fp32 angle.
//
// Programmatic dependent launch: the norm weights are read before the grid-dependency wait (they never come
// from the previous kernel), and the next kernel (the q_b projection) is released right after it: its own
// wait still covers this grid's writes.
//
// Legality: plain loads / stores, shuffles and griddepcontrol only; 8 B of static shared memory per warp.
// Built for sm_90a and sm_120a.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_glue_row.cuh"
#include "pdl.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using namespace k26_glue;

__global__ void __launch_bounds__(kThreads) mla_glue_kernel(const GlueParams p) { glue_token(p, blockIdx.x); }

}  // namespace

K26_EXPORT int k26_mla_glue_max_width() { return 8 * kMaxChunks * kThreads; }

// Returns a cudaError_t. Shapes, strides, dtypes and alignment are validated by the Python front door
// (k26/ops/glue_cuda.py).
K26_EXPORT int k26_mla_glue(const void* q, const void* kv, const void* q_w, const void* kv_w, const void* pos,
                            const void* inv_freq, const void* rows, const void* prefix, void* q_out, void* cache,
                            long long q_ld, long long kv_ld, long long c_row, long long c_tok, int T, int N, int Q,
                            int R, int P, float eps, int pdl, void* stream) {
  GlueParams p;
  p.q = static_cast<const __nv_bfloat16*>(q), p.kv = static_cast<const __nv_bfloat16*>(kv);
  p.q_w = static_cast<const __nv_bfloat16*>(q_w), p.kv_w = static_cast<const __nv_bfloat16*>(kv_w);
  p.pos = static_cast<const long long*>(pos), p.inv_freq = static_cast<const float*>(inv_freq);
  p.rows = static_cast<const long long*>(rows), p.prefix = static_cast<const long long*>(prefix);
  p.q_out = static_cast<__nv_bfloat16*>(q_out), p.cache = static_cast<__nv_bfloat16*>(cache);
  p.q_ld = q_ld, p.kv_ld = kv_ld, p.c_row = c_row, p.c_tok = c_tok;
  p.N = N, p.Q = Q, p.R = R, p.P = P, p.eps = eps;
  return (int)launch_pdl(mla_glue_kernel, dim3(T), dim3(kThreads), 0, pdl, static_cast<cudaStream_t>(stream), p);
}
