"""Is the one-token MoE gate/up's ~10 µs for 16.5 MB (1.6 TB/s after the ids are known,
profiling/results/2026-12-01-moe_trace-h200.md) the memory system's answer to its access pattern, or the
kernel's own chain (ids, x staging, the warps' reduction)? Read kernels, each alone in a CUDA graph after a
256 MB L2 flush (timing.graph_time_cold; an empty launch gives the fixed cost):

  contiguous     the 8 experts' weight bytes as one contiguous buffer, grid-stride, 4 loads in flight a thread
                 (bench_linear's floor walk)
  experts        the same bytes where they live (8 random experts of the [E, tiles, chunks, 32] repacked
                 layout), the same walk with the blocks split over the 8 regions
  pattern U=..   the gate/up kernel's walk and consumption (csrc/moe_gemm.cuh, gated_one_token: dequant + mma
                 of every chunk, no reduction or store): a block per (16-row tile, expert), the expert id read
                 from global memory first as in the kernel, warp w streams chunks [14w, 14w + 14) of its tile
                 U chunks a round (8: the kernel's 8 then 6; 14: all at once, ~150 B of spills at the kernel's
                 80-register bound; 4), with the scale words (+ 1.8 MB)
  ... no scales  the same without the scale loads
  ... interleaved warp w streams chunks w, w + 8, ... (a block's rounds are then contiguous)
  ... ids as arguments  the expert ids passed by value (no dependent first load)
  ... no dequant / mma  the walk without its arithmetic (the loads xor-folded); "no dequant": the mma on the
                 raw words; "no mma": the dequant xor-folded; "two accumulator chains": even / odd chunks
                 into separate fragments (a different summation order: a timing row only)
  ... round-major  round r of all the expert's tiles side by side (one contiguous front an expert)
  ... x from L1   B fragments loaded from x at each chunk (no 14 KB staging, no block barrier)
  ... x staged by cp.async  the staging's copies back to back (the kernel's loop waits an L2 round trip each)
  ... scales inside the weight stream  each chunk's 64 B of scale words right behind its 512 B of weights
  U=14 at 2 blocks / SM  every chunk of a warp in flight at once, ~105 registers, no spills (the probe's 256
                 blocks fit 2 a SM on 132 SMs; the kernel's 288 with the shared expert would not)
  tiles          a block per (expert, tile) streaming its 57 KB in order, 4 loads a thread, no arithmetic

    python profiling/debug/moe_read_probe.py [--experts 8] [--out FILE.md]
    ncu --kernel-name regex:pattern_read --launch-skip 2 -c 1 --set full --import-source yes \
        python profiling/debug/moe_read_probe.py --launch "U=14 at 2 blocks / SM (all"   (one row, eager)

Reading: pattern ≈ experts ≈ contiguous: the memory system serves the walk at the floor and the kernel's
~10 µs is its chain; pattern ≫ experts: the walk (round depth, scales, warp layout: the rows say which) costs.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from timing import build_cu, copy_bandwidth, graph_time_cold, report, source_commit

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "k26", "ops", "csrc")
E, TILES, KC = 384, 32, 112  # K2.6 at a TP8 rank: 384 experts, 2 x 256 rows = 32 tiles, K = 7168 = 112 x 64

PROBE_CU = r"""
#include <cuda_runtime.h>
#include <stdint.h>

#include "moe_mma.cuh"  // the MoE kernels' dequant and mma (built with -I k26/ops/csrc)

struct Ids {  // up to 16 expert ids by value (no dependent read)
  long long e[16];
};
__device__ __forceinline__ long long pick(const Ids& a, int i) {  // a.e[i] without a local-memory copy
  long long r = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) r = j == i ? a.e[j] : r;
  return r;
}

// Grid-stride over one region of `per` uint4 per blockIdx.y (region r at p + off.e[r] uint4s), 4 loads in
// flight a thread: bench_linear's floor walk, the regions side by side.
__global__ void __launch_bounds__(256) stride_read(const uint4* p, Ids off, int per, uint4* sink) {
  const uint4* q = p + pick(off, blockIdx.y);
  const int s = gridDim.x * blockDim.x;
  uint4 acc = make_uint4(0, 0, 0, 0), v[4];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < per; i += 4 * s) {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i + j * s < per ? __ldcs(q + i + j * s) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc.x ^= v[j].x, acc.y ^= v[j].y, acc.z ^= v[j].z, acc.w ^= v[j].w;
  }
  if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u) *sink = acc;  // keeps the loads; never true
}

// The gate/up kernel's walk (csrc/moe_gemm.cuh's routed loop, gated_one_token's depth) with its consumption:
// each chunk dequantised and multiplied as there (moe_mma.cuh), B = the token's 32 bytes from its row staged
// in shared memory behind the first round, as the kernel does. Block (tile, j), warp w, U chunks a round,
// loads guarded by the runtime k range as in the kernel: with compile-time rounds ptxas pipelined the loads
// three or four deep whatever U was (checked in the SASS); guarded, each round's loads issue before its first
// multiply, as in the kernel's SASS.
// flags (run time): 1 scales (else scale 1.0), 2 interleaved chunks (warp w: w, w + 8, ...), 4 the expert id
// read from global memory (else from the arguments).
constexpr int KMAX = 7168;  // the staged row's capacity: K2.6's hidden size
// MODE (compile time, so the base row is the kernel's walk alone, 70 registers as at a7e7641):
//   8 no consumption (the loads xor-folded: the walk without its dequant + mma)
//   16 round-major placement (round r of every tile of the expert side by side: the concurrent front of the
//      expert's 32 blocks is one contiguous run instead of 32 runs 57 KB apart)
//   32 the mma on the raw words (no dequant), 64 the dequant xor-folded (no mma), 128 even / odd chunks into
//      two accumulators, 256 B from x directly (no staging), 512 the scale words inside the weight stream,
//      1024 x staged by cp.async
template <int U, int MINB = 3, int MODE = 0>
__global__ void __launch_bounds__(256, MINB) pattern_read(const uint4* w, const uint32_t* s,
                                                       const long long* ids, Ids arg, int kc, int tiles,
                                                       int flags, const uint4* xrow, uint4* sink) {
  const int lane = threadIdx.x & 31, wk = threadIdx.x >> 5, g = lane >> 2, t = lane & 3, per = kc / 8;
  const long long e = (flags & 4) ? __ldcg(ids + blockIdx.y) : pick(arg, blockIdx.y);
  const bool scales = flags & 1, inter = flags & 2;
  constexpr bool consume = !(MODE & 8), rmajor = MODE & 16, no_dq = MODE & 32, no_mma = MODE & 64;
  constexpr bool two_acc = MODE & 128, x_l1 = MODE & 256, in_stream = MODE & 512, x_async = MODE & 1024;
  constexpr int CH = in_stream ? 36 : 32;  // uint4 a chunk: the lanes' words (+ its 64 B of scales in-stream)
  float acc2[4] = {0.f, 0.f, 0.f, 0.f};
  // warp-chunk i of this warp -> chunk index within the expert (tile-major as the repack lays it out, or
  // round-major: rounds of U chunks a warp, every tile's warps side by side a round)
  auto at = [&](int i) -> size_t {
    if constexpr (!rmajor) {
      return ((size_t)blockIdx.x * kc) + (inter ? wk + 8 * i : wk * per + i);
    } else {
      const int r = i / U, nr = min(U, per - r * U);
      return (size_t)tiles * 8 * r * U + ((size_t)blockIdx.x * 8 + wk) * nr + (i - r * U);
    }
  };
  const size_t ebase = (size_t)e * tiles * kc;
  uint4 fold = make_uint4(0, 0, 0, 0);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  __shared__ uint4 xs[KMAX / 8];  // the token's row, staged as gated_one_token does (B from shared memory)
  for (int i0 = 0; i0 < per; i0 += U) {
    uint4 v[U];
    uint32_t sv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u;
      if (i < per) {
        const size_t ch = ebase + at(i);
        v[u] = __ldcs(w + ch * CH + lane);
        if constexpr (in_stream)  // the chunk's scale words right behind its weights: one stream
          sv[u] = __ldcs(reinterpret_cast<const uint32_t*>(w + ch * CH + 32) + 2 * g + (t >> 1));
        else
          sv[u] = scales ? __ldg(s + ch * 16 + 2 * g + (t >> 1)) : 0x3f803f80u;
      }
    }
    if (i0 == 0 && !x_l1) {  // x staged behind the first round's loads, as in the kernel
      if constexpr (x_async) {  // cp.async, 4 unrolled copies a thread, as -DK26_MOE_GU_XASYNC's
#pragma unroll
        for (int j = 0; j < KMAX / 8 / 256 + 1; ++j) {
          const int i = threadIdx.x + j * 256;
          if (i >= kc * 8) break;
          const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(xs + i));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(xrow + i) : "memory");
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
      } else {  // the kernel's loop: LDG, STS, branch (one L2 round trip an iteration)
        for (int i = threadIdx.x; i < kc * 8; i += blockDim.x) xs[i] = __ldcg(xrow + i);
      }
      __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u, c = inter ? wk + 8 * i : wk * per + i;  // k position: placement-independent
      if (i >= per) break;
      if constexpr (!consume) {
        fold.x ^= v[u].x ^ sv[u], fold.y ^= v[u].y, fold.z ^= v[u].z, fold.w ^= v[u].w;
        continue;
      }
      const uint4 zero = make_uint4(0, 0, 0, 0);
      uint4 b[2];
      if constexpr (x_l1) {  // B straight from x (L1 after the SM's first warp): no staging, no block barrier
        b[0] = g == 0 ? __ldg(xrow + c * 8 + 2 * t) : zero;
        b[1] = g == 0 ? __ldg(xrow + c * 8 + 2 * t + 1) : zero;
      } else {
        b[0] = g == 0 ? xs[c * 8 + 2 * t] : zero;
        b[1] = g == 0 ? xs[c * 8 + 2 * t + 1] : zero;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t word = j == 0 ? v[u].x : j == 1 ? v[u].y : j == 2 ? v[u].z : v[u].w;
        uint32_t a[4];
        if constexpr (no_dq) {  // the raw word as the fragments: the mma chain without the dequant
          a[0] = word, a[1] = word ^ sv[u], a[2] = word >> 4, a[3] = word >> 8;
        } else {
          k26_moe::dequant(word, sv[u], a);
        }
        const uint4 bb = b[j >> 1];
        if constexpr (no_mma) {  // the dequant without the mma chain
          fold.x ^= a[0] ^ bb.x, fold.y ^= a[1] ^ bb.y, fold.z ^= a[2], fold.w ^= a[3];
        } else {
          k26_moe::mma_bf16(two_acc && (i & 1) ? acc2 : acc, a, (j & 1) ? bb.z : bb.x, (j & 1) ? bb.w : bb.y);
        }
      }
    }
  }
  acc[0] += acc2[0], acc[1] += acc2[1];
  if ((acc[0] == 1.2345f && acc[1] == acc[2]) || (fold.x == 0x9e3779b9u && fold.y == 0x7f4a7c15u))
    *sink = make_uint4(1, 2, 3, 4);  // keeps the work; never true
}

// Each block streams its own (expert, tile) region, 57 KB contiguous at K2.6 TP8, 4 loads in flight a
// thread, no consumption: the kernel's 256 separate streams without its rounds or arithmetic.
__global__ void __launch_bounds__(256) tile_read(const uint4* w, Ids arg, int kc, int tiles, uint4* sink) {
  const uint4* q = w + ((size_t)pick(arg, blockIdx.y) * tiles + blockIdx.x) * kc * 32;
  const int per = kc * 32;
  uint4 acc = make_uint4(0, 0, 0, 0), v[4];
  for (int i = threadIdx.x; i < per; i += 4 * 256) {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i + j * 256 < per ? __ldcs(q + i + j * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc.x ^= v[j].x, acc.y ^= v[j].y, acc.z ^= v[j].z, acc.w ^= v[j].w;
  }
  if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u) *sink = acc;  // keeps the loads; never true
}

Ids ids_of(const long long* host, int n) {
  Ids r = {};
  for (int i = 0; i < n && i < 16; ++i) r.e[i] = host[i];
  return r;
}
// off / ids_host: n host-side values (n <= 16). `grid` blocks in all, split evenly over the regions.
extern "C" int stride_launch(const void* p, const long long* off, int n_off, int per, void* sink, int grid,
                             void* st) {
  const dim3 g(grid / n_off > 0 ? grid / n_off : 1, n_off);
  stride_read<<<g, 256, 0, (cudaStream_t)st>>>((const uint4*)p, ids_of(off, n_off), per, (uint4*)sink);
  return (int)cudaGetLastError();
}
extern "C" int tile_launch(const void* w, const long long* ids_host, int kc, int tiles, int n, void* sink,
                           void* st) {
  tile_read<<<dim3(tiles, n), 256, 0, (cudaStream_t)st>>>((const uint4*)w, ids_of(ids_host, n), kc, tiles,
                                                          (uint4*)sink);
  return (int)cudaGetLastError();
}
// The (U, blocks a SM, MODE) instances the rows use.
#define K26_PROBE_CASES(X)                                                                          \
  X(4, 3, 0) X(8, 3, 0) X(8, 3, 8) X(8, 3, 16) X(8, 3, 24) X(8, 3, 32) X(8, 3, 64) X(8, 3, 128)       \
  X(8, 3, 256) X(8, 3, 512) X(8, 3, 768) X(8, 3, 1024) X(8, 3, 1032) X(14, 3, 0) X(14, 2, 0)          \
  X(14, 2, 8) X(14, 2, 32) X(14, 2, 64)
extern "C" int pattern_launch(int u, int minb, int mode, const void* w, const void* s, const void* ids,
                              const long long* ids_host, int kc, int tiles, int n, int flags, const void* x,
                              void* sink, void* st) {
  if (kc > KMAX / 64 || kc % 8) return (int)cudaErrorInvalidValue;
  const dim3 grid(tiles, n);
  const Ids arg = ids_of(ids_host, n);
  cudaStream_t q = (cudaStream_t)st;
  const uint4* W = (const uint4*)w;
  const uint32_t* S = (const uint32_t*)s;
  const long long* I = (const long long*)ids;
  const uint4* X = (const uint4*)x;
  uint4* K = (uint4*)sink;
#define K26_PROBE_CASE(U_, B_, M_)                                                       \
  if (u == U_ && minb == B_ && mode == M_) {                                             \
    pattern_read<U_, B_, M_><<<grid, 256, 0, q>>>(W, S, I, arg, kc, tiles, flags, X, K); \
    return (int)cudaGetLastError();                                                      \
  }
  K26_PROBE_CASES(K26_PROBE_CASE)
#undef K26_PROBE_CASE
  return (int)cudaErrorInvalidValue;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--launch",
        default=None,
        help="launch only the row named this (or the one row whose name contains it), eagerly, 3 times, no "
        "timing (for ncu: "
        "ncu --kernel-name regex:pattern_read --launch-skip 2 -c 1 --set full ... --launch 'no mma')",
    )
    a = ap.parse_args()
    n = a.experts
    if not 1 <= n <= 16:
        ap.error(f"--experts must be in 1..16, got {n}")
    dev = torch.device("cuda")
    lib = build_cu(PROBE_CU, "moe_read_probe", includes=[CSRC])
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.stride_launch.argtypes = [vp, vp, i32, i32, vp, i32, vp]
    lib.pattern_launch.argtypes = [i32, i32, i32, vp, vp, vp, vp, i32, i32, i32, i32, vp, vp, vp]
    lib.tile_launch.argtypes = [vp, vp, i32, i32, i32, vp, vp]
    copy_bw = copy_bandwidth()
    per_expert = TILES * KC * 32  # uint4 of one expert's gate/up weights
    rand = lambda count: torch.randint(-(2**31), 2**31 - 1, (count,), dtype=torch.int32, device=dev)
    # w sized for the scales-in-stream rows' 36-uint4 chunks (the others use its first 32/36)
    w, s, flat = rand(E * per_expert * 36 // 8), rand(E * TILES * KC * 16), rand(n * per_expert * 4)
    x = torch.randn(KC * 64, device=dev).to(torch.bfloat16)  # the token's row (K = 7168)
    ids_cpu = torch.randperm(E, generator=torch.Generator().manual_seed(0))[:n]
    ids = ids_cpu.to(dev)
    ids_host = (ctypes.c_longlong * n)(*ids_cpu.tolist())
    off_host = (ctypes.c_longlong * n)(*(ids_cpu * per_expert).tolist())
    zero_host = (ctypes.c_longlong * 1)(0)
    sink = torch.zeros(4, dtype=torch.int32, device=dev)
    st = lambda: torch.cuda.current_stream().cuda_stream
    grid = torch.cuda.get_device_properties(dev).multi_processor_count * 4

    def ok(rc: int) -> None:  # a failed launch would leave an empty graph and a believable time
        if rc:
            raise RuntimeError(f"moe_read_probe: launch failed, cudaError_t {rc}")

    def stride(buf, off, n_off, per):
        return lambda: ok(lib.stride_launch(buf.data_ptr(), off, n_off, per, sink.data_ptr(), grid, st()))

    def pattern(u, minb=3, mode=0, flags=1 | 4):  # flags: scales and the ids from memory, as the kernel
        args = (w.data_ptr(), s.data_ptr(), ids.data_ptr(), ids_host, KC, TILES, n, flags, x.data_ptr())
        return lambda: ok(lib.pattern_launch(u, minb, mode, *args, sink.data_ptr(), st()))

    wbytes, sbytes = n * per_expert * 16, n * TILES * KC * 64
    rows = [
        ("empty launch (fixed cost)", 0, stride(flat, zero_host, 1, 0)),
        ("contiguous", wbytes, stride(flat, zero_host, 1, n * per_expert)),
        (
            f"experts (grid-stride over the {n} regions)",
            wbytes,
            stride(w, off_host, n, per_expert),
        ),
        (
            "tiles (a block per expert tile, its 57 KB in order, no arithmetic)",
            wbytes,
            lambda: ok(lib.tile_launch(w.data_ptr(), ids_host, KC, TILES, n, sink.data_ptr(), st())),
        ),
        ("pattern U=8 (the kernel's walk)", wbytes + sbytes, pattern(8)),
        ("pattern U=8, no dequant / mma", wbytes + sbytes, pattern(8, mode=8)),
        ("pattern U=8, round-major placement", wbytes + sbytes, pattern(8, mode=16)),
        ("pattern U=8, round-major, no dequant / mma", wbytes + sbytes, pattern(8, mode=24)),
        ("pattern U=8, no scales", wbytes, pattern(8, flags=4)),
        ("pattern U=8, interleaved", wbytes + sbytes, pattern(8, flags=1 | 2 | 4)),
        ("pattern U=8, ids as arguments", wbytes + sbytes, pattern(8, flags=1)),
        ("pattern U=14 (all at once; spills at 80 registers)", wbytes + sbytes, pattern(14)),
        ("pattern U=4", wbytes + sbytes, pattern(4)),
        ("pattern U=8, mma on the raw words (no dequant)", wbytes + sbytes, pattern(8, mode=32)),
        ("pattern U=8, dequant without the mma", wbytes + sbytes, pattern(8, mode=64)),
        ("pattern U=8, two accumulator chains a warp", wbytes + sbytes, pattern(8, mode=128)),
        ("pattern U=8, x staged by cp.async", wbytes + sbytes, pattern(8, mode=1024)),
        ("pattern U=8, x staged by cp.async, no dequant / mma", wbytes + sbytes, pattern(8, mode=1032)),
        ("pattern U=8, x from L1 (no staging barrier)", wbytes + sbytes, pattern(8, mode=256)),
        ("pattern U=8, scales inside the weight stream", wbytes + sbytes, pattern(8, mode=512)),
        ("pattern U=8, x from L1 + scales in the stream", wbytes + sbytes, pattern(8, mode=768)),
        ("pattern U=14 at 2 blocks / SM (all at once, no spills)", wbytes + sbytes, pattern(14, 2)),
        ("pattern U=14 at 2 blocks / SM, no dequant", wbytes + sbytes, pattern(14, 2, 32)),
        ("pattern U=14 at 2 blocks / SM, no mma", wbytes + sbytes, pattern(14, 2, 64)),
        ("pattern U=14 at 2 blocks / SM, no dequant / mma", wbytes + sbytes, pattern(14, 2, 8)),
    ]
    out = [
        f"# moe_read_probe — {datetime.date.today()}",
        "",
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}; commit {source_commit()}",
        f"- command: `python profiling/debug/moe_read_probe.py --experts {n}`",
        f"- copy bandwidth measured in this run: {copy_bw / 1e12:.2f} TB/s (read + write bytes)",
        "- each row: one launch in a CUDA graph after a 256 MB L2 flush, median of 30 replays",
        "",
        "| read | MB | µs | µs over the empty launch | GB/s over the empty launch | % copy |",
        "|---|---|---|---|---|---|",
    ]
    if a.launch is not None:
        exact = [(name, fn) for name, _, fn in rows if name == a.launch]
        picked = exact or [(name, fn) for name, _, fn in rows if a.launch in name]
        if len(picked) != 1:
            ap.error(f"--launch {a.launch!r} matches {len(picked)} rows: {[n for n, _ in picked]}")
        for _ in range(3):
            picked[0][1]()
        torch.cuda.synchronize()
        print(f"launched 3x: {picked[0][0]}")
        return
    empty = None
    for name, nbytes, fn in rows:
        t = graph_time_cold(fn) * 1e6
        empty = t if empty is None else empty
        net = t - empty
        rate = nbytes / (net * 1e-6) if nbytes and net > 0 else 0.0
        gbs, pct = (f"{rate / 1e9:.0f}", f"{100 * rate / copy_bw:.0f}%") if rate else ("", "")
        out.append(f"| {name} | {nbytes / 1e6:.1f} | {t:.2f} | {net:.2f} | {gbs} | {pct} |")
    report("\n".join(out) + "\n", a.out)


if __name__ == "__main__":
    main()
