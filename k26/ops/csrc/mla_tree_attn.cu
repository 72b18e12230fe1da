// MLA tree attention over the latent KV cache: the host side of the kernel in csrc/mla_tree_attn_kernel.cuh
// (what it computes, its layout and its legality are described there) — the workspace layout, the launch plan
// (splits from the occupancy and the SM count), the launch, and the C exports the front door
// (k26/ops/attention_cuda.py) binds.

#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_merge_uv.cuh"
#include "mla_tree_attn_kernel.cuh"
#ifdef K26_ATTN_WIDE
#if defined(K26_ATTN_DEFER_VERIFY)
// K26_ATTN_DEFER_VERIFY defers the 32-row tiles' merge; the wide 64-row tiles always merge in the kernel.
#error "build K26_ATTN_DEFER_VERIFY or K26_ATTN_WIDE, not both"
#endif
#include "mla_tree_attn_wide.cuh"
#endif
#ifdef K26_ATTN_UNION
#if defined(K26_ATTN_WIDE)
#error "K26_ATTN_UNION chooses the wide tile per sequence itself: build it without K26_ATTN_WIDE"
#endif
#include "mla_tree_attn_union.cuh"
#endif
#include "smem_optin.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using namespace k26_attn;

// Query rows a block owns: 32 from 32 rows up. (16-row tiles up to N x H = 256, two blocks per SM, measured
// slower at the verify's N x H = 128: 20.6 -> 21.7 µs at 4K, 78.4 -> 85.6 at 32K;
// profiling/results/2026-12-04-variants-session17-h200.md.)
// -DK26_ATTN_WIDE: 64 from 64 rows up (csrc/mla_tree_attn_wide.cuh; an A/B side, k26/ops/build.py VARIANTS).
int tile_rows(int N, int H) {
#ifdef K26_ATTN_WIDE
  if (N * H >= 64) return 64;
#endif
  return N * H >= 32 ? 32 : 16;
}

// The kernel and its shared memory per tile rows BM: tree_attn_kernel<BM / 16> for 16 and 32, the wide one for 64.
template <int BM, bool ROPE>
constexpr auto kernel_of() {
#ifdef K26_ATTN_WIDE
  if constexpr (BM == 64) return tree_attn_wide_kernel<ROPE>;
  else
#endif
    return tree_attn_kernel<BM / 16, ROPE>;
}
template <int BM>
constexpr size_t smem_of() {
#ifdef K26_ATTN_WIDE
  if constexpr (BM == 64) return WideCfg::SMEM;
  else
#endif
    return Cfg<BM / 16>::SMEM;
}

// -DK26_ATTN_UNION: 32-row calls from N x H = K26_ATTN_UNION_MIN_ROWS launch the union kernel
// (csrc/mla_tree_attn_union.cuh). From 64 rows (session 29) the shapes left on the 32-row body lost 1.5-7 %
// inside it (N = 16 at 32K, H = 64 decode); N x H is known when a graph is captured, so the union can be kept
// to the shapes where the wide body's gain is large (N = 64 at H = 8: 10-20 % from 32K).
#ifndef K26_ATTN_UNION_MIN_ROWS
#define K26_ATTN_UNION_MIN_ROWS 512
#endif
bool union_call(int N, int H) {
#ifdef K26_ATTN_UNION
  return tile_rows(N, H) == 32 && N * H >= K26_ATTN_UNION_MIN_ROWS;
#else
  (void)N, (void)H;
  return false;
#endif
}

// Workspace layout, 256-B aligned: barriers (int32 [tiles][4]: generation, two arrival counts; a union call's
// wide tiles' after them) | split lse ([tiles][S_max][BM]) | split o partials ([tiles][S_max][BM][512]) | a union
// call's wide region: lse ([tiles_w][Sw][64]), o partials ([tiles_w][Sw][64][512]).
struct Layout {
  int BM, RT;
  size_t lse, o, total;
  int RTw = 0, Sw = 0;  // union calls: the wide layout's row tiles and splits (RTw x Sw <= RT x S_max)
  size_t counters_w = 0, lse_w = 0, o_w = 0;
};

Layout layout(int B, int N, int H, int S_max) {
  Layout w;
  w.BM = tile_rows(N, H);
  w.RT = (N * H + w.BM - 1) / w.BM;
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t tiles = (size_t)B * w.RT, parts = tiles * S_max * w.BM;
  size_t counters = tiles * 4 * 4;
  if (union_call(N, H)) {
    // Within the 32-row grid (RTw x Sw <= RT x S_max, so within its wave). A plan of one split (the grid may
    // then exceed a wave: no barrier) keeps the wide layout at one split too: its barrier would need a wave.
    w.RTw = (N * H + 63) / 64, w.Sw = S_max > 1 ? max(1, w.RT * S_max / w.RTw) : 1;
    w.counters_w = counters;
    counters += (size_t)B * w.RTw * 4 * 4;
  }
  w.lse = up(counters);
  w.o = w.lse + up(parts * 4);
  w.total = w.o + parts * DV * sizeof(PartT);
  if (w.Sw) {
    const size_t parts_w = (size_t)B * w.RTw * w.Sw * 64;
    w.lse_w = up(w.total);
    w.o_w = w.lse_w + up(parts_w * 4);
    w.total = w.o_w + parts_w * DV * sizeof(PartT);
  }
  return w;
}

// The layouts whose partials k26_mla_merge_uv reads: tree_attn_kernel's tiles that defer (kDeferMT; the wide and
// union kernels merge in the kernel).
bool deferrable(const Layout& w) { return w.BM <= 16 * kDeferMT && !w.Sw; }

template <int BM>
cudaError_t allow_smem() {
  return smem_opt_in<kernel_of<BM, false>(), kernel_of<BM, true>()>((int)smem_of<BM>());
}

// Blocks of one wave on the current device (the merge's barrier needs every live split of a row tile resident):
// SMs x the occupancy of the plain and the rotary kernel, the smaller; queried once per device.
template <int BM>
int wave_blocks(int* blocks) {
  static int cached[64];  // per device; 0: not yet queried (a benign race: every writer writes the same value)
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 64 && cached[dev] > 0) {
    *blocks = cached[dev];
    return 0;
  }
  if (const cudaError_t e = allow_smem<BM>(); e != cudaSuccess) return (int)e;
  int sms = 0, plain = 0, rotary = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&plain, kernel_of<BM, false>(), THREADS, smem_of<BM>());
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&rotary, kernel_of<BM, true>(), THREADS, smem_of<BM>());
  if (e != cudaSuccess) return (int)e;
  *blocks = sms * min(plain, rotary);
  if (dev < 64) cached[dev] = *blocks;
  return 0;
}

// Splits per row tile for (B, N, H): the whole grid in one wave.
template <int BM>
int plan(int B, int N, int H, int* splits) {
  int blocks = 0;
  if (const int e = wave_blocks<BM>(&blocks)) return e;
  *splits = max(1, min(1024, blocks / (B * layout(B, N, H, 1).RT)));
  return 0;
}

// More splits than one wave holds would leave the merge's barrier waiting for splits that cannot start:
// refused (the front door always launches the plan's count).
template <int BM>
int launch(const Params& p, const Rotary& rot, int B, bool pdl, cudaStream_t st) {
  if (const cudaError_t e = allow_smem<BM>(); e != cudaSuccess) return (int)e;
  int blocks = 0;
  if (const int e = wave_blocks<BM>(&blocks)) return e;
  if (p.S_max > 1 && (long long)B * p.RT * p.S_max > blocks) return (int)cudaErrorInvalidConfiguration;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(p.RT, p.S_max, B), c.blockDim = dim3(THREADS), c.dynamicSmemBytes = smem_of<BM>();
  c.stream = st, c.attrs = attr, c.numAttrs = pdl ? 1 : 0;
  return rot.q_pe ? (int)cudaLaunchKernelEx(&c, kernel_of<BM, true>(), p, rot)
                  : (int)cudaLaunchKernelEx(&c, kernel_of<BM, false>(), p, rot);
}

#ifdef K26_ATTN_UNION
// The union kernel over the 32-row layout's grid (p), the wide layout in pw; the same wave check.
int launch_union(const Params& p, const Params& pw, int wide_from, const Rotary& rot, int B, bool pdl,
                 cudaStream_t st) {
  using K = void (*)(Params, Rotary, Params, int);
  const K plain = tree_attn_union_kernel<false>, rotary = tree_attn_union_kernel<true>;
  if (const cudaError_t e = smem_opt_in<tree_attn_union_kernel<false>, tree_attn_union_kernel<true>>(
          (int)kUnionSmem);
      e != cudaSuccess)
    return (int)e;
  static int cached[64];  // blocks of one wave per device, as wave_blocks
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 64 || cached[dev] == 0) {
    int sms = 0, occ_p = 0, occ_r = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_p, plain, THREADS, kUnionSmem);
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_r, rotary, THREADS, kUnionSmem);
    if (e != cudaSuccess) return (int)e;
    if (dev >= 64) return (int)cudaErrorInvalidDevice;
    cached[dev] = sms * min(occ_p, occ_r);
  }
  if (p.S_max > 1 && (long long)B * p.RT * p.S_max > cached[dev]) return (int)cudaErrorInvalidConfiguration;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(p.RT, p.S_max, B), c.blockDim = dim3(THREADS), c.dynamicSmemBytes = kUnionSmem;
  c.stream = st, c.attrs = attr, c.numAttrs = pdl ? 1 : 0;
  return (int)cudaLaunchKernelEx(&c, rot.q_pe ? rotary : plain, p, rot, pw, wide_from);
}
#endif

}  // namespace

// Bytes of workspace for a (B, N, H, S_max) call; its first `k26_mla_tree_attn_counter_bytes` bytes must be
// zeroed once when it is allocated (the barriers' state; csrc/mla_attn_merge.cuh says what the kernel keeps).
K26_EXPORT size_t k26_mla_tree_attn_workspace(int B, int N, int H, int S_max) {
  return layout(B, N, H, S_max).total;
}
K26_EXPORT size_t k26_mla_tree_attn_counter_bytes(int B, int N, int H, int S_max) {
  return layout(B, N, H, S_max).lse;
}
#ifdef K26_ATTN_TRACE
K26_TRACE_EXPORTS(k26_mla_tree_attn_trace, k26_mla_tree_attn_trace_reset, g_attn_trace)
#endif
K26_EXPORT int k26_mla_tree_attn_tile_rows(int N, int H) { return tile_rows(N, H); }
// 1 when built with -DK26_ATTN_DEFER_VERIFY: the verify tree's 32-row tiles defer their merge to W_UV's kernel.
K26_EXPORT int k26_mla_merge_uv_defers_verify() { return kDeferMT > 1; }
// The launch plan for (B, N, H) on the current device: splits per row tile.
K26_EXPORT int k26_mla_tree_attn_plan(int B, int N, int H, int* splits) {
  switch (tile_rows(N, H)) {
    case 16: return plan<16>(B, N, H, splits);
#ifdef K26_ATTN_WIDE
    case 64: return plan<64>(B, N, H, splits);
#endif
    default: return plan<32>(B, N, H, splits);
  }
}

// Returns a cudaError_t. Shapes are validated by the Python front door (k26/ops/attention_cuda.py).
// q_pe (null: q holds all 576 dims): the rotary dims before RoPE, rows pe_ld apart, rotated by positions [B, N]
// and inv_freq [32] in the kernel; q then holds the 512 latent dims per row.
K26_EXPORT int k26_mla_tree_attn(const void* q, const void* cache, const int64_t* rows, const int64_t* prefix,
                                 const int64_t* words, void* out, float* lse, void* workspace, int B, int N, int H,
                                 int W, int max_len, int S_max, int min_keys, float scale, const void* q_pe,
                                 long long pe_ld, const int64_t* positions, const float* inv_freq, int defer_max,
                                 int pdl, void* stream) {
  if (S_max < 1) return (int)cudaErrorInvalidValue;
  const Layout w = layout(B, N, H, S_max);
  if (defer_max && !deferrable(w)) return (int)cudaErrorInvalidValue;  // what k26_mla_merge_uv reads
  char* ws = static_cast<char*>(workspace);
  Params p;
  p.q = (const __nv_bfloat16*)q, p.cache = (const __nv_bfloat16*)cache, p.rows = rows, p.prefix = prefix,
  p.words = words, p.out = (__nv_bfloat16*)out, p.lse = lse;
  p.counters = reinterpret_cast<int*>(ws), p.lse_part = reinterpret_cast<float*>(ws + w.lse),
  p.o_part = reinterpret_cast<PartT*>(ws + w.o);
  p.N = N, p.H = H, p.W = W, p.R = N * H, p.RT = w.RT, p.max_len = max_len, p.S_max = S_max,
  p.min_keys = min_keys < BN ? BN : min_keys;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.defer_max = defer_max;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const Rotary rot{(const __nv_bfloat16*)q_pe, positions, inv_freq, pe_ld};
#ifdef K26_ATTN_UNION
  if (w.Sw) {  // the wide layout: its own region, half the row tiles, the plain split minimum
    Params pw = p;
    pw.counters = reinterpret_cast<int*>(ws + w.counters_w), pw.lse_part = reinterpret_cast<float*>(ws + w.lse_w),
    pw.o_part = reinterpret_cast<PartT*>(ws + w.o_w);
    pw.RT = w.RTw, pw.S_max = w.Sw, pw.min_keys = max(BN, p.min_keys / 2);
    return launch_union(p, pw, kUnionKeysPerSplit * w.Sw, rot, B, pdl != 0, st);
  }
#endif
  switch (w.BM) {
    case 16: return launch<16>(p, rot, B, pdl != 0, st);
#ifdef K26_ATTN_WIDE
    case 64: return launch<64>(p, rot, B, pdl != 0, st);
#endif
    default: return launch<32>(p, rot, B, pdl != 0, st);
  }
}

// W_UV after a k26_mla_tree_attn call of the same (B, N, H, max_len, S_max, min_keys, defer_max) on this stream, its
// workspace and its output `out`: y [B, N, H, V] = W_UV[h] . o (csrc/mla_merge_uv.cuh), merging the splits of the
// sequences the attention left unmerged. w: head h's row v at w + h * w_h + v * w_v (512 contiguous bf16, 16-B
// aligned). rows_per_warp: 2 or 8 W_UV rows a warp (16 warps a block; V a multiple of the block's rows), chosen
// by the front door. Returns a cudaError_t; the front door (k26/ops/attention_uv_cuda.py) checks shapes.
K26_EXPORT int k26_mla_merge_uv(const void* workspace, const void* out, const int64_t* prefix, const void* w,
                                long long w_h, long long w_v, void* y, int B, int N, int H, int V, int max_len,
                                int S_max, int min_keys, int defer_max, int rows_per_warp, int pdl,
                                void* stream) {
  const Layout lay = layout(B, N, H, S_max);
  const int rows = UV_WARPS * rows_per_warp;  // W_UV rows a block
  if (S_max < 1 || (rows_per_warp != 2 && rows_per_warp != 8) || V % rows || !deferrable(lay))
    return (int)cudaErrorInvalidValue;
  const char* ws = static_cast<const char*>(workspace);
  MergeUV m{reinterpret_cast<const float*>(ws + lay.lse), reinterpret_cast<const PartT*>(ws + lay.o),
            (const __nv_bfloat16*)out, prefix, (const __nv_bfloat16*)w, w_h, w_v, (__nv_bfloat16*)y,
            N, H, N * H, V, max_len, S_max, min_keys < BN ? BN : min_keys, defer_max, lay.BM, lay.RT};
  const dim3 grid(N * H, V / rows, B);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  return (int)(rows_per_warp == 2 ? launch_pdl(merge_uv_kernel<2>, grid, dim3(UV_THREADS), 0, pdl != 0, st, m)
                                   : launch_pdl(merge_uv_kernel<8>, grid, dim3(UV_THREADS), 0, pdl != 0, st, m));
}
