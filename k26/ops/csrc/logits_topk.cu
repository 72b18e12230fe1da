// Log-sum-exp and top-k of rows of fp32 logits: what the DDTree draft reads of each depth's vocabulary shard
// (VocabHead.topk_logprobs), in two launches where torch ran ~30 kernels (logsumexp, a four-pass multi-block
// radix top-k, a sort: ~78 µs for 15 rows of 20,480 on an H100, profiling/debug/topk_probe.py).
//
//   values[r] = the k largest x[r, :], descending (equal values: the lower index first; NaN above everything,
//               -0.0 equal to +0.0 — torch.sort(descending=True, stable=True)'s order), indices[r] their columns,
//   lse[r]    = log sum exp x[r, :] (torch.logsumexp's convention for infinite maxima)
//
// 1. topk_chunk_kernel, grid (chunks of 4,096 columns, rows): each thread holds 16 logits; the chunk's max and
//    sum of exp (shifted by that max when finite) and its top min(k, columns) by a block-wide radix select of the k-th
//    largest order key (four 8-bit digit passes over a histogram a warp, plain shared atomics), then, only
//    when more keys equal that one than are needed, a binary search
//    over the column for the lowest-index ones. The candidates (key, column, value) go to the workspace.
// 2. topk_merge_kernel, grid (rows): the same select over the row's chunks' candidates (<= 4,096: k x chunks),
//    the k chosen ranked by one compare each against the others (sorted output), the chunks' (max, sum)
//    pairs merged in chunk order by one warp (fixed shuffle tree): deterministic, no float atomics. An
//    infinite row maximum or a NaN decides the row's value as torch.logsumexp's (+-inf, NaN); a chunk with
//    no finite logit adds nothing else (its sum is 0, or NaN).
// The select takes exactly the top min(k, n) of its keys whatever the order they arrive in (the compaction's
// shared-memory slots are in arrival order, the merge does not depend on it, the final rank does not either).
//
// Legality: shared-memory atomics, warp shuffles and redux.sync (sm_80+), no tensor cores; ~9 KB static shared
// memory: legal on sm_120 and sm_90; built for sm_90a and sm_120a.
// Benchmark: profiling/debug/topk_probe.py (graph replay, against torch.topk + logsumexp).

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int THREADS = 256, PER = 16, CHUNK = THREADS * PER;  // 4,096 columns a chunk block
constexpr int MAX_K = 64;                                        // the selected entries a block keeps in shared memory

// fp32 order as unsigned order; 0 marks "no element" (every real key is >= 0x007fffff, -inf's).
__device__ __forceinline__ uint32_t order_key(float f) {
  if (isnan(f)) return 0xffffffffu;  // NaN above +inf, as torch.sort ranks it
  uint32_t u = __float_as_uint(f);
  if ((u << 1) == 0) u = 0;  // -0.0 == +0.0: the column decides
  return (u >> 31) ? ~u : (u | 0x80000000u);
}

// One thread block's sum of a per-thread count (every thread gets it).
__device__ __forceinline__ int block_sum(int c, int* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  c = __reduce_add_sync(~0u, c);
  __syncthreads();  // red is free (the previous sum's readers are past it)
  if (lane == 0) red[warp] = c;
  __syncthreads();
  int s = 0;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) s += red[w];
  return s;
}

struct Picked {  // the selected entries, in shared memory (arrival order)
  uint32_t key[MAX_K];
  int col[MAX_K];
  float val[MAX_K];
  int n;
};

// A histogram a warp, plain shared atomics: the lanes of a warp adding once per digit by __match_any_sync (64
// matches a thread) before were most of each kernel's time — 15 x 20,480 on an H100: 21.9 + 22.4 -> 11.1 + 8.9
// µs, 15 x 163,840: 82.2 + 22.3 -> 25.1 + 9.3 (2026-12-06-topk-warp-hist-session33-h100.md).
constexpr int kHists = THREADS / 32;
struct SelectSmem {
  uint32_t hist[kHists][256];
  uint32_t digit, above;
  int red[THREADS / 32];
};

// The top `want` (<= MAX_K, <= the real keys held) of the block's keys (key 0: no element) into `out`, in
// arrival order: the want-th largest key T by radix select, then every key > T and the lowest columns of those
// == T. Columns are distinct and < 2^bits.
__device__ void select_top(const uint32_t (&key)[PER], const int (&col)[PER], const float (&val)[PER], int want,
                           int bits, SelectSmem& sm, Picked& out) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint32_t prefix = 0, pmask = 0;
  int kk = want;  // rank of T among the keys matching the prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
#pragma unroll
    for (int h = 0; h < kHists; ++h) sm.hist[h][tid] = 0;  // THREADS == 256 bins
    __syncthreads();
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const bool in = key[j] != 0 && (key[j] & pmask) == prefix;
      const uint32_t d = (key[j] >> shift) & 255u;
      if (in) atomicAdd(&sm.hist[warp][d], 1u);
    }
    __syncthreads();
    if (warp == 0) {  // lane l holds bins 255 - 8l down to 248 - 8l: lane order is descending digit order
      uint32_t c[8], sum = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        c[b] = 0;
#pragma unroll
        for (int h = 0; h < kHists; ++h) c[b] += sm.hist[h][255 - 8 * lane - b];
        sum += c[b];
      }
      uint32_t incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t t = __shfl_up_sync(~0u, incl, o);
        if (lane >= o) incl += t;
      }
      uint32_t run = incl - sum;  // keys in higher digits
      if (run < (uint32_t)kk && (uint32_t)kk <= incl) {
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          if (run + c[b] >= (uint32_t)kk) {
            sm.digit = 255 - 8 * lane - b, sm.above = run;
            break;
          }
          run += c[b];
        }
      }
    }
    __syncthreads();
    prefix |= sm.digit << shift, pmask |= 255u << shift, kk -= (int)sm.above;
  }
  const uint32_t T = prefix;  // the want-th largest key; kk of the keys == T are taken
  int eq = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j) eq += key[j] == T;
  uint32_t below = 0xffffffffu;  // take the keys == T with col < below
  if (block_sum(eq, sm.red) > kk) {  // more ties than places: the lowest columns (invariant: lo < need <= hi)
    uint32_t lo = 0, hi = 1u << bits;
    while (hi - lo > 1) {
      const uint32_t mid = (lo + hi) / 2;
      int c = 0;
#pragma unroll
      for (int j = 0; j < PER; ++j) c += key[j] == T && (uint32_t)col[j] < mid;
      if (block_sum(c, sm.red) >= kk) hi = mid;
      else lo = mid;
    }
    below = hi;  // exactly kk columns below it (columns are distinct)
  }
  if (tid == 0) out.n = 0;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    if (key[j] > T || (key[j] == T && key[j] != 0 && (uint32_t)col[j] < below)) {
      const int p = atomicAdd(&out.n, 1);
      out.key[p] = key[j], out.col[p] = col[j], out.val[p] = val[j];
    }
  }
  __syncthreads();
}

struct Work {  // [rows][chunks] (max, sum of exp shifted by it when finite) and [rows][chunks][k] candidates
  float *max, *sum;
  uint32_t* key;
  int* col;
  float* val;
};

__host__ __device__ inline Work carve(void* base, int R, int C, int k) {
  char* p = static_cast<char*>(base);
  const size_t rc = (size_t)R * C, rck = rc * k;
  Work w{};
  w.max = reinterpret_cast<float*>(p), p += rc * 4;
  w.sum = reinterpret_cast<float*>(p), p += rc * 4;
  w.key = reinterpret_cast<uint32_t*>(p), p += rck * 4;
  w.col = reinterpret_cast<int*>(p), p += rck * 4;
  w.val = reinterpret_cast<float*>(p);
  return w;
}

__device__ __forceinline__ int col_bits(int n) { return n <= 1 ? 1 : 32 - __clz(n - 1); }

__global__ void __launch_bounds__(THREADS) topk_chunk_kernel(const float* __restrict__ x, int V, int k, Work w) {
  __shared__ SelectSmem sm;
  __shared__ Picked out;
  __shared__ float red_f[THREADS / 32];
  const int r = blockIdx.y, c = blockIdx.x, C = gridDim.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* row = x + (size_t)r * V;
  uint32_t key[PER];
  int col[PER];
  float val[PER];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < PER; ++j) {  // coalesced: column c * 4096 + j * 256 + tid
    col[j] = c * CHUNK + j * THREADS + tid;
    const bool in = col[j] < V;
    val[j] = in ? row[col[j]] : -INFINITY;
    key[j] = in ? order_key(val[j]) : 0u;
    m = fmaxf(m, val[j]);  // (NaN ignored here; the sum below carries it)
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  if (lane == 0) red_f[warp] = m;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < THREADS / 32; ++i) m = fmaxf(m, red_f[i]);
  const float shift = isinf(m) ? 0.f : m;  // torch.logsumexp: an infinite max shifts by 0
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) s += col[j] < V ? expf(val[j] - shift) : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
  __syncthreads();  // red_f's max readers are done
  if (lane == 0) red_f[warp] = s;
  __syncthreads();
  if (tid == 0) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; ++i) t += red_f[i];
    w.max[(size_t)r * C + c] = m, w.sum[(size_t)r * C + c] = t;
  }
  const int real = min(CHUNK, V - c * CHUNK), want = min(k, real);
  select_top(key, col, val, want, col_bits(V), sm, out);
  if (tid < k) {  // the chunk's candidates; places past `want` are empty (key 0)
    const size_t at = ((size_t)r * C + c) * k + tid;
    w.key[at] = tid < want ? out.key[tid] : 0u;
    w.col[at] = tid < want ? out.col[tid] : 0;
    w.val[at] = tid < want ? out.val[tid] : 0.f;
  }
}

__global__ void __launch_bounds__(THREADS) topk_merge_kernel(int V, int C, int k, Work w, float* __restrict__ values,
                                                        int64_t* __restrict__ indices, float* __restrict__ lse) {
  __shared__ SelectSmem sm;
  __shared__ Picked out;
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
  const int n = C * k;  // <= CHUNK (the host's check)
  uint32_t key[PER];
  int col[PER];
  float val[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = j * THREADS + tid;
    const size_t at = (size_t)r * n + i;
    key[j] = i < n ? w.key[at] : 0u;
    col[j] = i < n ? w.col[at] : 0;
    val[j] = i < n ? w.val[at] : 0.f;
  }
  const int want = min(k, V);
  select_top(key, col, val, want, col_bits(V), sm, out);
  if (tid < want) {  // rank: the chosen entries that come before this one (larger key, or equal and a lower column)
    const uint32_t mk = out.key[tid];
    const int mc = out.col[tid];
    int rank = 0;
    for (int i = 0; i < want; ++i) rank += out.key[i] > mk || (out.key[i] == mk && out.col[i] < mc);
    values[(size_t)r * k + rank] = out.val[tid];
    indices[(size_t)r * k + rank] = mc;
  }
  if (tid < 32) {  // the chunks' (max, sum) in chunk order: lane l holds chunks l, l + 32, ...
    const float* cm = w.max + (size_t)r * C;
    const float* cs = w.sum + (size_t)r * C;
    float g = -INFINITY;  // the row's max (NaN ignored: a NaN logit made its chunk's sum NaN)
    bool nan = false;
    for (int c = lane; c < C; c += 32) g = fmaxf(g, cm[c]), nan |= isnan(cs[c]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) g = fmaxf(g, __shfl_xor_sync(~0u, g, o));
    nan = __any_sync(~0u, nan);
    float s = 0.f;  // (g finite: no chunk max is +inf; a chunk of -inf only adds its 0)
    for (int c = lane; c < C; c += 32) s += isfinite(cm[c]) ? cs[c] * expf(cm[c] - g) : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
    if (lane == 0) lse[r] = nan ? NAN : isfinite(g) ? g + logf(s) : g;  // torch.logsumexp's +-inf and NaN
  }
}

}  // namespace

K26_EXPORT int k26_logits_topk_max_k() { return MAX_K; }
K26_EXPORT int k26_logits_topk_chunk() { return CHUNK; }

K26_EXPORT size_t k26_logits_topk_workspace(int R, int V, int k) {
  const size_t C = (size_t)(V + CHUNK - 1) / CHUNK;
  return (size_t)R * C * (8 + 12 * (size_t)k);
}

// x [R, V] fp32 contiguous; values [R, k] fp32, indices [R, k] int64, lse [R] fp32. 1 <= k <= min(V, MAX_K),
// chunks x k <= CHUNK, R <= 65535 (the front door's plan).
K26_EXPORT int k26_logits_topk(const float* x, int R, int V, int k, float* values, int64_t* indices, float* lse,
                               void* workspace, void* stream) {
  const int C = (V + CHUNK - 1) / CHUNK;
  if (R < 1 || R > 65535 || V < 1 || k < 1 || k > MAX_K || k > V || C * k > CHUNK) return (int)cudaErrorInvalidValue;
  const Work w = carve(workspace, R, C, k);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  topk_chunk_kernel<<<dim3(C, R), THREADS, 0, st>>>(x, V, k, w);
  topk_merge_kernel<<<R, THREADS, 0, st>>>(V, C, k, w, values, indices, lse);
  return (int)cudaGetLastError();
}
