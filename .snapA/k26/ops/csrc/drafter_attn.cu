// DFlash drafter attention (`torch.ops.k26.drafter_attention`): the block's queries over the drafter's
// cached context K/V and the block's own K/V, grouped-query attention, no mask inside the visible keys.
//
//   out[b, s, h] = softmax_j(scale * q[b, s, h] . k[j]) v[j]   over j = the context rows cache[rows[b], 0 ..
//   ctx_b) (ctx_b = ctx_lens[b] clamped to the cache length) then the S block rows, all visible; KV head
//   h / (Hq / Hkv).
//
// Shape: the drafter runs it once per layer per draft, 8 block rows x Hq / Hkv heads = 64 query rows per KV head
// at K2.6 (TP 8: 8 heads over 1 KV head; TP 1: 8 over each of 8), head_dim 128, bf16. 64 rows make the work
// balanced between bytes and mma.sync FLOPs (128 FLOP per byte of K/V), so the keys are split over the SMs
// (flash decoding) and every split multiplies on tensor cores.
//
// Two launches, both with programmatic dependent launch:
//   1. split_kernel, grid (S_max splits, row tiles x Hkv, B): a block owns 64 query rows (the rows of one KV
//      head, (s, h) with heads fastest) and one contiguous chunk of the T = ctx + S keys; 4 warps, 16 rows
//      each, Q in registers (ldmatrix A fragments), 64-key K and V tiles through a 2-stage cp.async
//      pipeline, S = Q K^T and the online softmax in registers (no shared-memory round trip, no barrier
//      inside the softmax), O += P V from the same registers (FA2's C-to-A fragment reuse, V by
//      ldmatrix.trans). It writes its normalised fp32 partial and its lse. The live split count follows
//      the context length on the device (>= min_keys keys a split), so one graph serves every length.
//   2. merge_kernel, one block per query row: the live splits' partials weighted by their lse, summed in
//      split order (deterministic), bf16 out. No counters: nothing to reset between graph replays.
// A single-launch merge (the last block merging) would make one SM read every partial (33 x 32 KB at 4K):
// slower than the second launch's 1-2 µs.
//
// Legality: mma.sync.m16n8k16 bf16, ldmatrix, cp.async, griddepcontrol; <= 85 KB dynamic shared memory per
// block (head_dim 128): legal on sm_120 (99 KB) and sm_90; built for sm_90a and sm_120a. No host sync: CUDA-graph
// capturable. Benchmark: profiling/bench_drafter_attn.py (cold L2, graph replay), results in profiling/results/.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "pdl.cuh"
#include "smem_optin.cuh"
#include "warp_mma.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int BM = 64;        // query rows per block (4 warps x 16)
constexpr int BN = 64;        // keys per tile
constexpr int THREADS = 128;  // 4 warps
constexpr int NSTAGE = 2;     // K + V tiles in flight while the previous pair is multiplied
constexpr int MAX_SPLITS = 256;

template <int HD>
struct Cfg {
  static constexpr int LD = HD + 8;  // padded smem row: ldmatrix rows land on distinct banks
  static constexpr size_t Q = (size_t)BM * LD * 2, KV = (size_t)BN * LD * 2;
  static constexpr size_t SMEM = Q + NSTAGE * 2 * KV;
  static_assert(SMEM <= 101376, "sm_120 allows at most 99 KB of shared memory per block");
};

struct Params {
  const __nv_bfloat16* q;   // [B, S, Hq, HD]
  const __nv_bfloat16* ck;  // context keys, row r at + r * cache_ld: [T, Hkv, HD] per row
  const __nv_bfloat16* cv;  // context values, same layout
  const __nv_bfloat16* bk;  // block keys [B, S, Hkv, HD], token t of sequence b at + (b S + t) blk_ld_k
  const __nv_bfloat16* bv;  // block values, the same with blk_ld_v (a view into the qkv projection's output)
  const int64_t* rows;      // [B] cache row of each sequence
  const int64_t* ctx;       // [B] context rows visible (clamped to [0, T])
  __nv_bfloat16* out;       // [B, S, Hq, HD]
  float* o_part;            // [B, Hkv, RT, S_max, BM, HD]
  float* lse_part;          // [B, Hkv, RT, S_max, BM] (log2 domain)
  long long cache_ld;       // elements between cache rows
  long long blk_ld_k, blk_ld_v;  // elements between block tokens (Hkv * HD when packed)
  int S, Hq, Hkv, rep, R, RT, T, S_max, min_keys;
  float scale_log2;  // softmax scale * log2(e)
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Split geometry, identical in every block of a sequence and in the merge: visible context rows, live keys,
// keys per split (a multiple of BN) and the live split count.
struct Split {
  int ctx, n, chunk, active;
};
__device__ __forceinline__ Split split_geometry(const Params& p, int b) {
  Split g;
  const long long c = p.ctx[b];
  g.ctx = c < 0 ? 0 : c > p.T ? p.T : (int)c;
  g.n = g.ctx + p.S;
  const int want = max(1, min(p.S_max, (g.n + p.min_keys - 1) / p.min_keys));
  g.chunk = ((g.n + want - 1) / want + BN - 1) / BN * BN;
  g.active = (g.n + g.chunk - 1) / g.chunk;
  return g;
}

template <int HD>
static __global__ void __launch_bounds__(THREADS, 1) split_kernel(Params p) {
  using C = Cfg<HD>;
  constexpr int LD = C::LD, KD = HD / 16, NT = BN / 8, DT = HD / 8, CPR = HD / 8;  // CPR: 16-B chunks a row
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* sKV = reinterpret_cast<__nv_bfloat16*>(smem + C::Q);  // [stage][K | V][BN][LD]

  const int split = blockIdx.x, rt = blockIdx.y / p.Hkv, kvh = blockIdx.y % p.Hkv, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // The query, the block's K/V and the context rows come from the kernels before (projections, RoPE, the
  // context append): everything is read after the wait.
  pdl_wait();
  const Split sg = split_geometry(p, b);
  pdl_trigger();  // the merge may launch (it waits for this grid before reading the partials)
  if (split >= sg.active) return;
  const int k0 = split * sg.chunk, k1 = min(sg.n, k0 + sg.chunk), n_tiles = (k1 - k0 + BN - 1) / BN;
  const __nv_bfloat16* ckrow = p.ck + (size_t)p.rows[b] * p.cache_ld + (size_t)kvh * HD;
  const __nv_bfloat16* cvrow = p.cv + (size_t)p.rows[b] * p.cache_ld + (size_t)kvh * HD;
  const __nv_bfloat16* bkrow = p.bk + (size_t)b * p.S * p.blk_ld_k + (size_t)kvh * HD;  // token t at + t ld
  const __nv_bfloat16* bvrow = p.bv + (size_t)b * p.S * p.blk_ld_v + (size_t)kvh * HD;

  // Q: row i of the tile is query row rt * BM + i = (s, head kvh * rep + i % rep); rows past R are zeros.
  for (int c = tid; c < BM * CPR; c += THREADS) {
    const int i = c / CPR, col = (c % CPR) * 8, r = rt * BM + i;
    const bool live = r < p.R;
    const int s = live ? r / p.rep : 0, h = kvh * p.rep + (live ? r % p.rep : 0);
    cp_async16(sQ + i * LD + col, p.q + (((size_t)b * p.S + s) * p.Hq + h) * HD + col, live);
  }
  auto issue_tile = [&](int it) {
    __nv_bfloat16* sK = sKV + (size_t)(it % NSTAGE) * 2 * BN * LD;
    __nv_bfloat16* sV = sK + BN * LD;
    for (int c = tid; c < BN * CPR; c += THREADS) {
      const int r = c / CPR, col = (c % CPR) * 8, j = k0 + it * BN + r;
      const bool live = j < k1;
      const size_t cj = (size_t)j * p.Hkv * HD + col, bj = (size_t)max(j - sg.ctx, 0);
      const __nv_bfloat16* ks = !live ? p.bk : j < sg.ctx ? ckrow + cj : bkrow + bj * p.blk_ld_k + col;
      const __nv_bfloat16* vs = !live ? p.bv : j < sg.ctx ? cvrow + cj : bvrow + bj * p.blk_ld_v + col;
      cp_async16(sK + r * LD + col, ks, live);  // keys past the split's end: zero-filled, masked below
      cp_async16(sV + r * LD + col, vs, live);
    }
  };
  issue_tile(0);
  cp_commit();  // group 0: Q and tile 0
  if (n_tiles > 1) issue_tile(1);
  cp_commit();  // group 1: tile 1 (maybe empty)

  uint32_t qf[KD][4];
  float o[DT][4];
#pragma unroll
  for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.f, 0.f};  // rows g and g + 8 of the warp's 16

  for (int it = 0; it < n_tiles; ++it) {
    cp_wait<1>();  // this tile's group has landed (the next one may still fly)
    __syncthreads();
    const __nv_bfloat16* sK = sKV + (size_t)(it % NSTAGE) * 2 * BN * LD;
    const __nv_bfloat16* sV = sK + BN * LD;
    if (it == 0) {
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) ldsm_x4(qf[kk], sQ + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
    }
    // S = Q K^T for the warp's 16 rows x BN keys.
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t kb[4];
        ldsm_x4(kb, sK + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
        mma_bf16(s[2 * np], qf[kk], kb[0], kb[1]);
        mma_bf16(s[2 * np + 1], qf[kk], kb[2], kb[3]);
      }
    }
    // Online softmax in the log2 domain; a thread holds columns 2t, 2t + 1 of each n-tile for rows g, g + 8.
    const int key0 = k0 + it * BN;
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool live = key0 + n * 8 + 2 * t + (e & 1) < k1;
        s[n][e] = live ? s[n][e] * p.scale_log2 : -CUDART_INF_F;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      alpha[r] = exp2f(m[r] - mx[r]);  // m = -inf on the first tile: 0 (every tile holds a live key)
      m[r] = mx[r];
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - m[e >> 1]);
        l[e >> 1] += s[n][e];
      }
#pragma unroll
    for (int d = 0; d < DT; ++d) o[d][0] *= alpha[0], o[d][1] *= alpha[0], o[d][2] *= alpha[1], o[d][3] *= alpha[1];
    // O += P V: P's C fragments are the A fragments of the next mma (two n-tiles per 16-key k-step).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t vb[4];
        ldsm_x4_t(vb, sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * 16 + (lane >> 4) * 8);
        mma_bf16(o[2 * dp], a, vb[0], vb[1]);
        mma_bf16(o[2 * dp + 1], a, vb[2], vb[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    if (it + NSTAGE < n_tiles) issue_tile(it + NSTAGE);
    cp_commit();
  }

  // Normalised partial and its lse (log2 domain).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  const size_t tile = (((size_t)b * p.Hkv + kvh) * p.RT + rt) * p.S_max + split;
  float* op = p.o_part + tile * BM * HD;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    const float inv = 1.f / l[r];
#pragma unroll
    for (int d = 0; d < DT; ++d)
      __stcg(reinterpret_cast<float2*>(op + (size_t)row * HD + d * 8 + 2 * t),
             make_float2(o[d][2 * r] * inv, o[d][2 * r + 1] * inv));
    if (t == 0) __stcg(p.lse_part + tile * BM + row, m[r] + __log2f(l[r]));
  }
}

// One block per query row: the live splits' partials weighted by softmax of their lse, in split order.
// Threads: HD / 4 columns (float4 each) x G split groups; group k sums splits k, k + G, ...; the groups'
// sums are added in group order.
template <int HD>
static __global__ void __launch_bounds__(THREADS) merge_kernel(Params p) {
  constexpr int CW = HD / 4, G = THREADS / CW;
  __shared__ float w[MAX_SPLITS];
  __shared__ float4 part[G][CW];
  __shared__ float s_inv;
  const int i = blockIdx.x, rt = blockIdx.y / p.Hkv, kvh = blockIdx.y % p.Hkv, b = blockIdx.z;
  const int r = rt * BM + i, tid = threadIdx.x;
  pdl_wait();  // the split kernel's partials
  const int active = split_geometry(p, b).active;  // the lengths are read before dependents may start
  pdl_trigger();
  if (r >= p.R) return;
  const size_t tile0 = (((size_t)b * p.Hkv + kvh) * p.RT + rt) * p.S_max;
  for (int k = tid; k < active; k += THREADS) w[k] = __ldcg(p.lse_part + (tile0 + k) * BM + i);
  __syncthreads();
  if (tid < 32) {
    float mx = -CUDART_INF_F;
    for (int k = tid; k < active; k += 32) mx = fmaxf(mx, w[k]);
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int k = tid; k < active; k += 32) {
      const float e = exp2f(w[k] - mx);
      w[k] = e, sum += e;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (tid == 0) s_inv = 1.f / sum;
  }
  __syncthreads();
  const int grp = tid / CW, c = tid % CW;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int k = grp; k < active; k += G) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p.o_part + ((tile0 + k) * BM + i) * HD) + c);
    const float wk = w[k];
    acc.x += wk * v.x, acc.y += wk * v.y, acc.z += wk * v.z, acc.w += wk * v.w;
  }
  part[grp][c] = acc;
  __syncthreads();
  if (grp) return;
  float4 sum = part[0][c];
#pragma unroll
  for (int k = 1; k < G; ++k) sum.x += part[k][c].x, sum.y += part[k][c].y, sum.z += part[k][c].z, sum.w += part[k][c].w;
  const float inv = s_inv;
  const int s = r / p.rep, h = kvh * p.rep + r % p.rep;
  __nv_bfloat16* dst = p.out + (((size_t)b * p.S + s) * p.Hq + h) * HD + c * 4;
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(sum.x * inv, sum.y * inv);
  *reinterpret_cast<__nv_bfloat162*>(dst + 2) = __floats2bfloat162_rn(sum.z * inv, sum.w * inv);
}

template <int HD>
cudaError_t allow_smem() {
  return smem_opt_in<split_kernel<HD>>((int)Cfg<HD>::SMEM);
}

template <int HD>
int plan(int tiles, int* splits) {
  if (const cudaError_t e = allow_smem<HD>(); e != cudaSuccess) return (int)e;
  int dev = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const cudaError_t e =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, split_kernel<HD>, THREADS, Cfg<HD>::SMEM);
  if (e != cudaSuccess) return (int)e;
  *splits = max(1, min(MAX_SPLITS, per_sm * sms / max(tiles, 1)));  // one wave of blocks
  return 0;
}

template <int HD>
int launch(const Params& p, int B, bool pdl, cudaStream_t st) {
  if (const cudaError_t e = allow_smem<HD>(); e != cudaSuccess) return (int)e;
  const int tiles = p.RT * p.Hkv;
  cudaError_t e = launch_pdl(split_kernel<HD>, dim3(p.S_max, tiles, B), dim3(THREADS), Cfg<HD>::SMEM, pdl, st, p);
  if (e == cudaSuccess) e = launch_pdl(merge_kernel<HD>, dim3(BM, tiles, B), dim3(THREADS), 0, pdl, st, p);
  return (int)e;
}

}  // namespace

K26_EXPORT int k26_drafter_attn_block_rows() { return BM; }

// Splits per (row tile, KV head) on the current device for `tiles` = B x Hkv x row tiles.
K26_EXPORT int k26_drafter_attn_plan(int head_dim, int tiles, int* splits) {
  if (head_dim == 128) return plan<128>(tiles, splits);
  if (head_dim == 64) return plan<64>(tiles, splits);
  return (int)cudaErrorInvalidValue;
}

// Returns a cudaError_t. Shapes are validated by the Python front door (k26/ops/drafter_attn_cuda.py);
// o_part / lse_part: [B, Hkv, RT, S_max, 64, head_dim] and [B, Hkv, RT, S_max, 64] fp32, any contents.
// blk_ld_k / blk_ld_v: elements between consecutive block tokens of k_blk / v_blk (rows of a sequence's S tokens
// packed one after the other, heads HD apart within a token).
K26_EXPORT int k26_drafter_attn(const void* q, const void* ck, const void* cv, long long cache_ld, const void* bk,
                                const void* bv, long long blk_ld_k, long long blk_ld_v, const int64_t* rows,
                                const int64_t* ctx, void* out, float* o_part, float* lse_part, int B, int S, int Hq,
                                int Hkv, int head_dim, int T, int S_max, int min_keys, float scale, int pdl,
                                void* stream) {
  if (S_max < 1 || S_max > MAX_SPLITS || S < 1 || Hkv < 1 || Hq < 1 || Hq % Hkv) return (int)cudaErrorInvalidValue;
  Params p;
  p.q = (const __nv_bfloat16*)q, p.ck = (const __nv_bfloat16*)ck, p.cv = (const __nv_bfloat16*)cv;
  p.bk = (const __nv_bfloat16*)bk, p.bv = (const __nv_bfloat16*)bv, p.rows = rows, p.ctx = ctx;
  p.blk_ld_k = blk_ld_k, p.blk_ld_v = blk_ld_v;
  p.out = (__nv_bfloat16*)out, p.o_part = o_part, p.lse_part = lse_part, p.cache_ld = cache_ld;
  p.S = S, p.Hq = Hq, p.Hkv = Hkv, p.rep = Hq / Hkv, p.R = S * (Hq / Hkv), p.RT = (p.R + BM - 1) / BM, p.T = T;
  p.S_max = S_max, p.min_keys = min_keys < BN ? BN : min_keys;
  p.scale_log2 = scale * 1.4426950408889634f;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (head_dim == 128) return launch<128>(p, B, pdl != 0, st);
  if (head_dim == 64) return launch<64>(p, B, pdl != 0, st);
  return (int)cudaErrorInvalidValue;
}
