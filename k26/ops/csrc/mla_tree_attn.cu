// MLA tree attention over the latent KV cache (absorbed MLA: one shared 576-wide key per token, values
// its first 512 dims) for DDTree verification, decode (N = 1) and DFlash chains (causal trees).
//
//   out[b, n, h] = softmax_j(scale * q[b, n, h] . K[b, j]) V[b, j],   lse[b, n, h] = log sum_j exp(...)
//   keys j: the prefix cache[rows[b], 0 .. L_b) (all visible) then the N new rows cache[rows[b], L_b + i]
//   (visible when bit i of the ancestor mask words[b, n] is set).
//
// Design: the N*H query rows of a sequence are tiled 32 at a time; grid = (row tiles, S + 1 splits, B),
// row tiles of a split adjacent so a KV tile fetched from HBM is re-read from L2 by the other row tiles.
// Splits 0..S-1 cover the prefix with no mask (the active split count adapts on the device to L_b, at
// least 128 keys each); split S is the tree block with the bitmask. Each split keeps an online softmax
// and writes its normalised partial output and log-sum-exp; a merge kernel combines them in fp32.
// Per 16-key tile: cp.async double-buffered K tile, S = Q K^T by 8 warps (row tile x key tile x K-half,
// halves summed in shared memory), softmax by one warp, O += P V with each warp owning 64 of the 512
// output columns (V = the first 512 dims of the same K tile, read through ldmatrix.trans).
//
// Legality: mma.sync.m16n8k16 bf16, ldmatrix, cp.async only; 80.8 KB dynamic shared memory per block:
// legal on sm_120 (99 KB) and sm_90; built for sm_90a and sm_120a.
// Benchmark: profiling/bench_tree_attn.py, results in profiling/results/.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int DQK = 576, DV = 512;
constexpr int BM = 32, BN = 16, THREADS = 256;
constexpr int LDS = DQK + 8;  // padded row: 1168 B = 292 words, ldmatrix rows land on distinct banks
constexpr int LDP = 24;       // P rows padded likewise
constexpr int MIN_SPLIT_KEYS = 128;

constexpr size_t SMEM_Q = BM * LDS * 2, SMEM_K = 2 * BN * LDS * 2, SMEM_S = 2 * BM * BN * 4, SMEM_P = BM * LDP * 2;
constexpr size_t SMEM_BYTES = SMEM_Q + SMEM_K + SMEM_S + SMEM_P + 3 * BM * 4;
static_assert(SMEM_BYTES <= 101376, "sm_120 allows at most 99 KB of shared memory per block");

struct Params {
  const __nv_bfloat16* q;      // [B, N, H, 576]
  const __nv_bfloat16* cache;  // [cache rows, max_len, 576]
  const int64_t* rows;         // [B]
  const int64_t* prefix;       // [B]
  const int64_t* words;        // [B, N, W]
  float* o_part;               // [B, S + 1, R_pad, 512]
  float* lse_part;             // [B, S + 1, R_pad]
  int N, H, W, R, R_pad, max_len, S;
  float scale_log2;  // softmax scale * log2(e): scores live in the exp2 domain
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

__global__ void __launch_bounds__(THREADS) split_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem + SMEM_Q);
  float* sS = reinterpret_cast<float*>(smem + SMEM_Q + SMEM_K);  // [2 halves][BM][BN]
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + SMEM_Q + SMEM_K + SMEM_S);
  float* sAlpha = reinterpret_cast<float*>(smem + SMEM_Q + SMEM_K + SMEM_S + SMEM_P);
  float* sM = sAlpha + BM;
  float* sL = sM + BM;

  const int rt_blk = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int row0 = rt_blk * BM;
  const int L = static_cast<int>(p.prefix[b]);
  const bool tree = split == p.S;
  int k0, k1;
  if (tree) {
    k0 = L, k1 = L + p.N;
  } else {
    const int active = min(p.S, max(1, (L + MIN_SPLIT_KEYS - 1) / MIN_SPLIT_KEYS));
    const int chunk = ((L + active - 1) / active + BN - 1) / BN * BN;
    k0 = split * chunk, k1 = min(L, k0 + chunk);
  }
  k1 = min(k1, p.max_len);  // never read past the sequence's cache row
  const size_t part = (size_t)b * (p.S + 1) + split;
  if (k0 >= k1) {  // empty split: the merge skips it
    if (tid < BM) p.lse_part[part * p.R_pad + row0 + tid] = -CUDART_INF_F;
    return;
  }
  const __nv_bfloat16* kv = p.cache + (size_t)p.rows[b] * p.max_len * DQK;

  // Q tile (rows past R are zero) and the first K tile.
  for (int i = tid; i < BM * (DQK / 8); i += THREADS) {
    const int r = i / (DQK / 8), c = (i % (DQK / 8)) * 8;
    const int row = min(row0 + r, p.R - 1);
    cp_async16(sQ + r * LDS + c, p.q + ((size_t)b * p.R + row) * DQK + c, row0 + r < p.R);
  }
  auto load_k = [&](int buf, int key0) {
    for (int i = tid; i < BN * (DQK / 8); i += THREADS) {
      const int r = i / (DQK / 8), c = (i % (DQK / 8)) * 8;
      const int key = min(key0 + r, k1 - 1);
      cp_async16(sK + (buf * BN + r) * LDS + c, kv + (size_t)key * DQK + c, key0 + r < k1);
    }
  };
  load_k(0, k0);
  cp_commit();

  float m_run = -CUDART_INF_F, l_run = 0.f;  // warp 0, lane = row
  const int my_row = row0 + lane;
  const int64_t* my_words = p.words + ((size_t)b * p.N + min(my_row, p.R - 1) / p.H) * p.W;

  float o[2][8][4];
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[a][n][i] = 0.f;

  const int srt = warp & 1, skt = (warp >> 1) & 1, skh = warp >> 2;  // S-phase role
  const int n_tiles = (k1 - k0 + BN - 1) / BN;
  for (int it = 0; it < n_tiles; ++it) {
    const int buf = it & 1, key0 = k0 + it * BN;
    if (it + 1 < n_tiles) {
      load_k(buf ^ 1, key0 + BN);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* tK = sK + buf * BN * LDS;

    // S = Q K^T: this warp does rows srt*16.., keys skt*8.., dims [skh*288, skh*288 + 288).
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 3
    for (int ks = 0; ks < 18; ks += 2) {
      const int d0 = skh * 288 + ks * 16;
      uint32_t bk[4];
      ldsm_x4(bk, tK + (skt * 8 + (lane & 7)) * LDS + d0 + (lane >> 3) * 8);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t a[4];
        ldsm_x4(a, sQ + (srt * 16 + (lane & 15)) * LDS + d0 + h * 16 + (lane >> 4) * 8);
        mma_bf16(s, a, bk[2 * h], bk[2 * h + 1]);
      }
    }
    float* sSh = sS + skh * BM * BN;
    sSh[(srt * 16 + g) * BN + skt * 8 + 2 * t] = s[0];
    sSh[(srt * 16 + g) * BN + skt * 8 + 2 * t + 1] = s[1];
    sSh[(srt * 16 + g + 8) * BN + skt * 8 + 2 * t] = s[2];
    sSh[(srt * 16 + g + 8) * BN + skt * 8 + 2 * t + 1] = s[3];
    __syncthreads();

    if (warp == 0) {  // online softmax, one lane per query row
      float sc[BN];
      float mx = m_run;
#pragma unroll
      for (int j = 0; j < BN; ++j) {
        const int key = key0 + j;
        bool vis = key < k1 && my_row < p.R;
        if (tree && vis) {
          const int i = key - L;
          vis = (my_words[i >> 6] >> (i & 63)) & 1;
        }
        sc[j] = vis ? (sS[lane * BN + j] + sS[BM * BN + lane * BN + j]) * p.scale_log2 : -CUDART_INF_F;
        mx = fmaxf(mx, sc[j]);
      }
      float alpha = 1.f, sum = 0.f;
      if (mx != -CUDART_INF_F) {
        alpha = exp2f(m_run - mx);  // 0 when m_run is -inf
#pragma unroll
        for (int j = 0; j < BN; ++j) {
          const float pj = exp2f(sc[j] - mx);
          sP[lane * LDP + j] = __float2bfloat16(pj);
          sum += pj;  // unrounded, as FlashAttention does: keeps the log-sum-exp fp32-accurate
        }
        m_run = mx;
      } else {
#pragma unroll
        for (int j = 0; j < BN; ++j) sP[lane * LDP + j] = __float2bfloat16(0.f);
      }
      l_run = l_run * alpha + sum;
      sAlpha[lane] = alpha;
    }
    __syncthreads();

    // O = alpha * O + P V over this warp's 64 output columns.
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const float al0 = sAlpha[a * 16 + g], al1 = sAlpha[a * 16 + g + 8];
#pragma unroll
      for (int n = 0; n < 8; ++n) o[a][n][0] *= al0, o[a][n][1] *= al0, o[a][n][2] *= al1, o[a][n][3] *= al1;
    }
    uint32_t pa[2][4];
#pragma unroll
    for (int a = 0; a < 2; ++a) ldsm_x4(pa[a], sP + (a * 16 + (lane & 15)) * LDP + (lane >> 4) * 8);
#pragma unroll
    for (int n2 = 0; n2 < 4; ++n2) {
      const int c = warp * 64 + n2 * 16;
      uint32_t vb[4];
      ldsm_x4_t(vb, tK + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + c + (lane >> 4) * 8);
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        mma_bf16(o[a][2 * n2], pa[a], vb[0], vb[1]);
        mma_bf16(o[a][2 * n2 + 1], pa[a], vb[2], vb[3]);
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this K buffer
  }

  if (warp == 0) {
    sM[lane] = m_run;
    sL[lane] = l_run;
    if (my_row < p.R_pad)
      p.lse_part[part * p.R_pad + my_row] =
          l_run > 0.f ? (m_run + __log2f(l_run)) * 0.69314718055994531f : -CUDART_INF_F;
  }
  __syncthreads();
  float* op = p.o_part + part * p.R_pad * DV;
#pragma unroll
  for (int a = 0; a < 2; ++a) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = a * 16 + g + hh * 8;
      const float l = sL[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int c = warp * 64 + n * 8 + 2 * t;
        *reinterpret_cast<float2*>(op + (size_t)(row0 + r) * DV + c) =
            make_float2(o[a][n][2 * hh] * inv, o[a][n][2 * hh + 1] * inv);
      }
    }
  }
}

// out[b, row] = sum_s w_s O_s / sum_s w_s with w_s = exp(lse_s - max lse); lse = max + log(sum w).
__global__ void merge_kernel(Params p, __nv_bfloat16* __restrict__ out, float* __restrict__ lse_out) {
  const int row = blockIdx.x, b = blockIdx.y, c = threadIdx.x * 4;
  const int parts = p.S + 1;
  const float* lp = p.lse_part + (size_t)b * parts * p.R_pad + row;
  float mx = -CUDART_INF_F;
  for (int s = 0; s < parts; ++s) mx = fmaxf(mx, lp[(size_t)s * p.R_pad]);
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, wsum = 0.f;
  if (mx != -CUDART_INF_F) {
    for (int s = 0; s < parts; ++s) {
      const float ls = lp[(size_t)s * p.R_pad];
      if (ls == -CUDART_INF_F) continue;
      const float w = __expf(ls - mx);
      const float4 v = *reinterpret_cast<const float4*>(p.o_part + (((size_t)b * parts + s) * p.R_pad + row) * DV + c);
      acc[0] += w * v.x, acc[1] += w * v.y, acc[2] += w * v.z, acc[3] += w * v.w;
      wsum += w;
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  __nv_bfloat16* o = out + ((size_t)b * p.R + row) * DV + c;
  *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(acc[0] * inv, acc[1] * inv);
  *reinterpret_cast<__nv_bfloat162*>(o + 2) = __floats2bfloat162_rn(acc[2] * inv, acc[3] * inv);
  if (threadIdx.x == 0) lse_out[(size_t)b * p.R + row] = wsum > 0.f ? mx + __logf(wsum) : -CUDART_INF_F;
}

size_t carve(int B, int R, int S, float** o_part, float** lse_part, char* base) {
  const int R_pad = (R + BM - 1) / BM * BM;
  const size_t o_bytes = (size_t)B * (S + 1) * R_pad * DV * 4;
  const size_t l_bytes = (size_t)B * (S + 1) * R_pad * 4;
  if (base) *o_part = reinterpret_cast<float*>(base), *lse_part = reinterpret_cast<float*>(base + o_bytes);
  return o_bytes + l_bytes;
}

}  // namespace

K26_EXPORT size_t k26_mla_tree_attn_workspace(int B, int N, int H, int S) {
  return carve(B, N * H, S, nullptr, nullptr, nullptr);
}

K26_EXPORT int k26_mla_tree_attn_smem() { return (int)SMEM_BYTES; }

// Returns a cudaError_t. Shapes are validated by the Python front door (k26/ops/attention_cuda.py).
K26_EXPORT int k26_mla_tree_attn(const void* q, const void* cache, const int64_t* rows, const int64_t* prefix,
                                 const int64_t* words, void* out, float* lse, void* workspace, int B, int N, int H,
                                 int W, int max_len, int S, float scale, void* stream) {
  static bool attr_set = false;  // per process; the attribute is per function, not per device
  if (!attr_set) {
    const cudaError_t e = cudaFuncSetAttribute(split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_BYTES);
    if (e != cudaSuccess) return (int)e;
    attr_set = true;
  }
  Params p;
  p.q = (const __nv_bfloat16*)q, p.cache = (const __nv_bfloat16*)cache, p.rows = rows, p.prefix = prefix,
  p.words = words, p.N = N, p.H = H, p.W = W, p.R = N * H, p.R_pad = (N * H + BM - 1) / BM * BM,
  p.max_len = max_len, p.S = S, p.scale_log2 = scale * 1.4426950408889634f;
  carve(B, p.R, S, &p.o_part, &p.lse_part, static_cast<char*>(workspace));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  split_kernel<<<dim3(p.R_pad / BM, S + 1, B), THREADS, SMEM_BYTES, st>>>(p);
  merge_kernel<<<dim3(p.R, B), DV / 4, 0, st>>>(p, (__nv_bfloat16*)out, lse);
  return (int)cudaGetLastError();
}
