// Tensor-parallel all-reduce fused with the residual add and the next RMSNorm, over peer-mapped memory:
//
//   s = bf16( sum_{q = 0 .. W-1} x_q )          x_q: rank q's bf16 partial [rows, D], summed in fp32 in RANK ORDER
//   h = bf16( residual + s )                    the new residual stream   -> res_out
//   y = bf16( weight * bf16( h * rsqrt(mean(h^2) + eps) ) )   HF RMSNorm  -> out
//
// Every rank ends with bit-identical h and y: the sum runs in the same order on every rank (one-shot) or on
// one rank only (two-shot), and y is computed by the same code from the same h.
//
// Workspace: one cudaMalloc per rank, shared with the peers once at start-up through CUDA IPC handles
// (k26/ops/allreduce_cuda.py). Layout (bytes): flags A [kMaxBlocks][kMaxRanks] u64 | flags B (same) | data A
// bf16 [2 slots][W][cap] | data B bf16 [2 slots][cap]. Data moves by PUSH: a rank writes its rows into the
// peers' workspaces (posted writes, the cheap direction over PCIe) and every wait spins on LOCAL memory.
//
// One-shot (small messages): block b pushes its rows (b, b + G, ...) of x to every rank's data A[slot][me],
// then raises its flag A[b][me] on every rank; after all W flags of block b arrived it sums the W partials
// in rank order, adds the residual and normalises the rows.
// Two-shot (rows >= W): rows are split into W contiguous slices, slice q owned by rank q. Phase A pushes
// slice q of x to rank q only (1/W of the bytes); the owner sums its slice in rank order, adds the residual
// and pushes h (bf16) to every rank's data B[slot] (phase B); every rank then normalises all rows from h.
//
// Protocol. The epoch e = ctl.epoch + 1 is the same for every block of a launch; the last block to finish
// a launch stores it back (the next launch on the stream cannot start before), so CUDA-graph replays count
// on by themselves. Flags hold (e << 32 | numel): a flag at epoch e means "my data of epoch e is in your
// memory", and numel catches ranks called with different sizes. Data is double-buffered by e & 1: a rank
// that reaches launch e has seen every peer's flag of e - 1, so every peer finished launch e - 2 and no
// longer reads slot e & 1 (block 0 runs in every launch and waits for every peer; a block index a launch
// does not use keeps an older epoch in its flags, never a newer one). The grid follows the rows (up to
// kMaxBlocks), so ranks called with different sizes may differ in grid: block 0 still meets on both and
// reports the mismatch, and the other blocks stop spinning when they see the error.
// Ordering: data stores, __syncthreads, then st.release.sys of the flag by one thread per peer (release is
// cumulative over the block's stores ordered before it by the barrier: the PTX memory model, as vLLM's
// custom all-reduce relies on); the reader's ld.acquire.sys, __syncthreads, then ld.global.cg (L2, never
// a stale L1 line).
// A wait longer than timeout_ns (a dead or stuck peer) or a size mismatch records (kind, peer) in ctl.err
// and in host-mapped memory for the front door's RuntimeError, and every later launch returns at once
// (outputs undefined) instead of hanging.
//
// Legality: plain loads / stores, ld.acquire / st.release at system scope, atomics, %globaltimer and
// griddepcontrol (programmatic dependent launch: sm_90 and sm_120 both have it); no multicast, NVLink or
// cluster features, no shared memory beyond 64 B: sm_120-legal. Built for sm_90a and sm_120a.
// Speed: one H200, world 1 (no peer: the kernel's own floor, in a graph): one-shot 5.9 us at
// 7168 x 1 to 12.5 us at 7168 x 256, two-shot 8.6 to 16.9 us, against 13.8-44.5 us for the add + RMSNorm
// as torch ops alone (profiling/results/2026-12-01-allreduce_fused-h200.md). Two H200s (NVLink, in a
// graph, residual + RMSNorm included): one-shot 8.2 us at 7168 x 1, 24.1 us at 7168 x 256, vs 22.3 / 81.6
// for NCCL + add + RMSNorm (profiling/results/2026-12-01-bench_tp2-fused-h200x2.md).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "globaltimer.cuh"
#include "pdl.cuh"
#include "rmsnorm_row.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using namespace k26_norm;  // kThreads, kMaxVec, the row arithmetic

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 96;   // one block per row up to here (fewer than the SMs of an H200 or RTX PRO 6000)
constexpr size_t kFlagsA = 0, kFlagsB = kMaxBlocks * kMaxRanks * 8, kDataA = 2 * kFlagsB;

struct Ctl {
  unsigned int epoch, done, err, info;
};

struct Params {
  const __nv_bfloat16* x;         // [rows, D] this rank's partial sum
  const __nv_bfloat16* residual;  // [rows, D]
  Row norm;                       // weight [D], out (normed) and res_out (h) [rows, D], D, eps
  char* ws[kMaxRanks];            // every rank's workspace as mapped in this process (ws[rank]: our own)
  Ctl* ctl;                       // this rank's, zeroed once
  unsigned int* host_err;         // host-mapped [2]: code, info
  long long timeout_ns, cap;      // cap: elements per data region
  int rows, rank, world, two_shot;
};

__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ long long now_ns() { return (long long)k26_globaltimer(); }

__device__ __forceinline__ unsigned long long* flag(const Params& p, int rank, size_t off, int src) {
  return reinterpret_cast<unsigned long long*>(p.ws[rank] + off) + blockIdx.x * kMaxRanks + src;
}

__device__ __forceinline__ __nv_bfloat16* data_a(const Params& p, int rank, int slot, int src) {
  return reinterpret_cast<__nv_bfloat16*>(p.ws[rank] + kDataA) + (size_t(slot) * p.world + src) * p.cap;
}

__device__ __forceinline__ __nv_bfloat16* data_b(const Params& p, int rank, int slot) {
  return reinterpret_cast<__nv_bfloat16*>(p.ws[rank] + kDataA) + (size_t(2) * p.world + slot) * p.cap;
}

// The first failure wins: kind 1 = timeout waiting for `peer`, kind 2 = `peer` called with `info` elements.
__device__ void report(const Params& p, unsigned kind, int peer, unsigned info) {
  const unsigned code = kind << 8 | unsigned(peer + 1);
  if (atomicCAS(&p.ctl->err, 0u, code) == 0u) {
    volatile unsigned* h = p.host_err;
    h[1] = info;
    __threadfence_system();
    h[0] = code;
  }
}

// Tell every rank that this block's pushes of epoch e (numel n) have landed. Call after the stores.
__device__ __forceinline__ void signal_all(const Params& p, size_t off, unsigned e, unsigned n) {
  __syncthreads();
  if (threadIdx.x < p.world) st_release_sys(flag(p, threadIdx.x, off, p.rank), (unsigned long long)e << 32 | n);
}

// Wait until every rank raised this block's flag for epoch e; false on a timeout, a mismatch or an earlier error.
__device__ bool wait_all(const Params& p, size_t off, unsigned e, unsigned n) {
  int bad = 0;
  if (threadIdx.x < p.world) {
    const unsigned long long* f = flag(p, p.rank, off, threadIdx.x);
    const long long t0 = now_ns();
    for (;;) {
      const unsigned long long v = ld_acquire_sys(f);
      const int ahead = int(unsigned(v >> 32) - e);  // wrap-safe: a fast peer may already be at e + 1
      if (ahead >= 0) {
        if (ahead == 0 && unsigned(v) != n) report(p, 2, threadIdx.x, unsigned(v)), bad = 1;
        break;
      }
      if (*reinterpret_cast<volatile unsigned*>(&p.ctl->err)) { bad = 1; break; }
      if (now_ns() - t0 > p.timeout_ns) { report(p, 1, threadIdx.x, 0), bad = 1; break; }
    }
  }
  return !__syncthreads_or(bad);
}

__device__ __forceinline__ uint4 ld_cg(const __nv_bfloat16* p) {
  return __ldcg(reinterpret_cast<const uint4*>(p));
}

// h = bf16(residual + bf16(sum over ranks in rank order)) for this thread's vectors of `row`.
__device__ void reduce_row(const Params& p, int row, int slot, float (&h)[kMaxVec][8]) {
  const int V = p.norm.D / 8;
#pragma unroll
  for (int k = 0; k < kMaxVec; ++k) {
    const int v = threadIdx.x + k * kThreads;
    if (v >= V) continue;
    const size_t at = size_t(row) * p.norm.D + size_t(v) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int q = 0; q < p.world; ++q) add8(acc, ld_cg(data_a(p, p.rank, slot, q) + at));
    add_residual(h[k], pack8(acc), *reinterpret_cast<const uint4*>(p.residual + at));
  }
}

// Copy this block's share of row `row` of `src` to `dst(q)` for the ranks q in [q0, q1).
template <typename Dst>
__device__ __forceinline__ void push_row(const Params& p, const __nv_bfloat16* src, int row, Dst dst, int q0,
                                         int q1) {
  const int V = p.norm.D / 8;
  for (int v = threadIdx.x; v < V; v += kThreads) {
    const size_t at = size_t(row) * p.norm.D + size_t(v) * 8;
    const uint4 val = *reinterpret_cast<const uint4*>(src + at);
    for (int i = 0; i < q1 - q0; ++i) {
      const int q = q0 + (p.rank + i) % (q1 - q0);  // start at a different peer on every rank: spread the links
      *reinterpret_cast<uint4*>(dst(q) + at) = val;
    }
  }
}

__device__ __forceinline__ int slice_lo(const Params& p, int q) { return int((long long)q * p.rows / p.world); }

__global__ void __launch_bounds__(kThreads) allreduce_add_rmsnorm_kernel(Params p) {
  // Programmatic dependent launch (a no-op when launched without it): the blocks become resident while the
  // kernel before finishes, and read nothing before it has (its outputs, and the epoch an all-reduce before
  // this one advanced); the kernel after may then start its own prologue (a projection's weight prefetch)
  // while this one waits on its peers — it reads our outputs only after its own wait, i.e. after we exit.
  // Every block triggers only once resident, so dependents never take the SMs this grid needs.
  const RowWeight wt = load_weight(p.norm);  // the norm weight (a constant) in flight across the waits
  pdl_wait();
  pdl_trigger();
  const unsigned e = *reinterpret_cast<volatile unsigned*>(&p.ctl->epoch) + 1u;
  const unsigned n = unsigned(p.rows) * unsigned(p.norm.D);
  const int slot = e & 1u;
  float h[kMaxVec][8];
  if (*reinterpret_cast<volatile unsigned*>(&p.ctl->err) == 0u) {
    if (!p.two_shot) {
      for (int row = blockIdx.x; row < p.rows; row += gridDim.x)
        push_row(p, p.x, row, [&](int q) { return data_a(p, q, slot, p.rank); }, 0, p.world);
      signal_all(p, kFlagsA, e, n);
      if (wait_all(p, kFlagsA, e, n)) {
        for (int row = blockIdx.x; row < p.rows; row += gridDim.x) {
          reduce_row(p, row, slot, h);
          finish_row(p.norm, row, h, wt);
        }
      }
    } else {
      for (int q = 0; q < p.world; ++q)  // slice q of x to its owner q
        for (int row = slice_lo(p, q) + blockIdx.x; row < slice_lo(p, q + 1); row += gridDim.x)
          push_row(p, p.x, row, [&](int) { return data_a(p, q, slot, p.rank); }, q, q + 1);
      signal_all(p, kFlagsA, e, n);
      bool ok = wait_all(p, kFlagsA, e, n);
      if (ok) {
        const int V = p.norm.D / 8;
        for (int row = slice_lo(p, p.rank) + blockIdx.x; row < slice_lo(p, p.rank + 1); row += gridDim.x) {
          reduce_row(p, row, slot, h);  // our slice: sum in rank order, then h to every rank's data B
#pragma unroll
          for (int k = 0; k < kMaxVec; ++k) {
            const int v = threadIdx.x + k * kThreads;
            if (v >= V) continue;
            const uint4 hv = pack8(h[k]);
            const size_t at = size_t(row) * p.norm.D + size_t(v) * 8;
            for (int i = 0; i < p.world; ++i)
              *reinterpret_cast<uint4*>(data_b(p, (p.rank + i) % p.world, slot) + at) = hv;
          }
        }
        signal_all(p, kFlagsB, e, n);
        ok = wait_all(p, kFlagsB, e, n);
      }
      if (ok) {
        const int V = p.norm.D / 8;
        for (int q = 0; q < p.world; ++q)
          for (int row = slice_lo(p, q) + blockIdx.x; row < slice_lo(p, q + 1); row += gridDim.x) {
#pragma unroll
            for (int k = 0; k < kMaxVec; ++k) {
              const int v = threadIdx.x + k * kThreads;
              if (v >= V) continue;
              const uint4 hv = ld_cg(data_b(p, p.rank, slot) + size_t(row) * p.norm.D + size_t(v) * 8);
              const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&hv);
#pragma unroll
              for (int j = 0; j < 8; ++j) h[k][j] = __bfloat162float(b[j]);
            }
            finish_row(p.norm, row, h, wt);
          }
      }
    }
  }
  // The last block out advances the epoch; the next launch on this stream starts after it.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&p.ctl->done, 1u) == gridDim.x - 1) {
      p.ctl->done = 0;
      p.ctl->epoch = e;
      __threadfence();
    }
  }
}

}  // namespace

// Workspace bytes for `world` ranks and `cap` elements per data region (data A: 2 x world, data B: 2).
K26_EXPORT size_t k26_ar_workspace_bytes(int world, long long cap) {
  return kDataA + size_t(2 * world + 2) * size_t(cap) * sizeof(__nv_bfloat16);
}

K26_EXPORT int k26_ar_limits(int* max_ranks, int* max_dim) {
  *max_ranks = kMaxRanks;
  *max_dim = 8 * kMaxVec * kThreads;
  return 0;
}

// The caller's current device is restored on the way out (torch keeps its own notion of it per thread).
struct DeviceGuard {
  int prev = -1;
  cudaError_t set(int device) {
    cudaError_t err = cudaGetDevice(&prev);
    return err == cudaSuccess ? cudaSetDevice(device) : err;
  }
  ~DeviceGuard() {
    if (prev >= 0) cudaSetDevice(prev);
  }
};

// cudaMalloc'd, zeroed workspace on `device` and its IPC handle (64 bytes) for the peers.
K26_EXPORT int k26_ar_alloc(int device, size_t bytes, void** ptr, void* handle) {
  DeviceGuard guard;
  cudaError_t err = guard.set(device);
  if (err == cudaSuccess) err = cudaMalloc(ptr, bytes);
  if (err == cudaSuccess) err = cudaMemset(*ptr, 0, bytes);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaIpcGetMemHandle(static_cast<cudaIpcMemHandle_t*>(handle), *ptr);
  return int(err);
}

K26_EXPORT int k26_ar_open(int device, const void* handle, void** ptr) {
  DeviceGuard guard;
  cudaError_t err = guard.set(device);
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof(h));
  if (err == cudaSuccess) err = cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
  return int(err);
}

K26_EXPORT int k26_ar_close(void* peer_ptr) { return int(cudaIpcCloseMemHandle(peer_ptr)); }

K26_EXPORT int k26_ar_free(void* ptr) { return int(cudaFree(ptr)); }

K26_EXPORT const char* k26_ar_error_string(int err) { return cudaGetErrorString(cudaError_t(err)); }

K26_EXPORT int k26_ar_launch(const void* x, const void* residual, const void* weight, void* out, void* res_out,
                             void* const* ws, void* ctl, void* host_err, long long timeout_ns, long long cap,
                             float eps, int rows, int D, int rank, int world, int two_shot, int pdl,
                             void* stream) {
  if (world < 1 || world > kMaxRanks || D % 8 || D > 8 * kMaxVec * kThreads) return int(cudaErrorInvalidValue);
  Params p{};
  p.x = static_cast<const __nv_bfloat16*>(x);
  p.residual = static_cast<const __nv_bfloat16*>(residual);
  p.norm = Row{static_cast<const __nv_bfloat16*>(weight), static_cast<__nv_bfloat16*>(out),
               static_cast<__nv_bfloat16*>(res_out), D, eps};
  for (int q = 0; q < world; ++q) p.ws[q] = static_cast<char*>(ws[q]);
  p.ctl = static_cast<Ctl*>(ctl);
  p.host_err = static_cast<unsigned*>(host_err);
  p.timeout_ns = timeout_ns;
  p.cap = cap;
  p.rows = rows;
  p.rank = rank;
  p.world = world;
  p.two_shot = two_shot;
  // One block per row (one-shot) or per row of the largest slice (two-shot), at most kMaxBlocks.
  const int units = two_shot ? (rows + world - 1) / world : rows;
  const int grid = units < 1 ? 1 : (units < kMaxBlocks ? units : kMaxBlocks);
  return int(launch_pdl(allreduce_add_rmsnorm_kernel, dim3(grid), dim3(kThreads), 0, pdl,
                        static_cast<cudaStream_t>(stream), p));
}
