// L2 prefetch of weights a later kernel of the step will stream: `torch.ops.k26.l2_prefetch`
// (k26/ops/prefetch_cuda.py). Why: at batch 1 most kernels of a decode layer are latency-bound (the tree
// attention reads 4.7 MB in ~10 µs at 4K context, the router's phase 2 and the norms read nothing), so HBM
// idles through most of the layer while the weight-streaming kernels (o_proj, the shared expert, the next
// layer's q_a / kv_a) each pay their bytes on the critical path. Issued before a latency-bound kernel, this
// launch moves those bytes into L2 in the background; the kernel that needs them then reads L2.
//
// One bulk prefetch instruction per 64 KB chunk (cp.async.bulk.prefetch.L2: no shared memory, no registers
// held, no completion to wait for), the chunks dealt round-robin over every thread of a small grid spread
// over the SMs (one SM's bulk-copy unit would issue them too slowly). Programmatic dependent launch: the
// dependents are released first thing (the next kernel runs alongside), the prefetches are issued, then the
// grid waits for the kernel before it — so the chain's ordering stays transitive through this launch — and
// bumps `ticket` (the launch count: the op's observable effect, which keeps torch.compile from dropping it).
//
// Legality: cp.async.bulk.prefetch.L2.global (sm_90 and later, sm_120 included), griddepcontrol; no
// shared memory. Built for sm_90a and sm_120a. Speed: profiling/bench_k26.py --l2-prefetch (the step A/B).

#include <cuda_runtime.h>
#include <stdint.h>

#include "pdl.cuh"

#define K26_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxRanges = 16;
constexpr unsigned kChunk = 64 << 10;  // bytes per prefetch instruction
constexpr int kThreads = 32;

struct Ranges {
  uint64_t begin[kMaxRanges];  // 16-byte aligned
  uint64_t bytes[kMaxRanges];  // multiples of 16
  int n;
  int* ticket;
};

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(const Ranges r) {
  pdl_trigger();
  const unsigned stride = gridDim.x * kThreads;
  unsigned i = blockIdx.x * kThreads + threadIdx.x;  // this thread's next chunk, counted over all ranges
  for (int k = 0; k < r.n; ++k) {
    const unsigned chunks = unsigned((r.bytes[k] + kChunk - 1) / kChunk);
    for (; i < chunks; i += stride) {
      const uint64_t off = uint64_t(i) * kChunk;
      const unsigned size = unsigned(min(uint64_t(kChunk), r.bytes[k] - off));
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(r.begin[k] + off), "r"(size) : "memory");
    }
    i -= chunks;  // >= 0: the loop left i at or past `chunks`
  }
  pdl_wait();
  if (blockIdx.x == 0 && threadIdx.x == 0) ++*r.ticket;
}

}  // namespace

K26_EXPORT int k26_l2_prefetch_max_ranges() { return kMaxRanges; }

// Returns a cudaError_t. begin / bytes: n ranges (the front door rounds them out to 16 bytes); blocks: the
// grid (the front door takes one block per SM, at most one per 64 KB chunk).
K26_EXPORT int k26_l2_prefetch(const uint64_t* begin, const uint64_t* bytes, int n, void* ticket, int blocks, int pdl,
                               void* stream) {
  if (n < 0 || n > kMaxRanges || blocks < 1 || ticket == nullptr) return int(cudaErrorInvalidValue);
  Ranges r = {};
  for (int k = 0; k < n; ++k) {
    if (begin[k] % 16 || bytes[k] % 16) return int(cudaErrorInvalidValue);
    r.begin[k] = begin[k], r.bytes[k] = bytes[k];
  }
  r.n = n, r.ticket = static_cast<int*>(ticket);
  return int(launch_pdl(l2_prefetch_kernel, dim3(blocks), dim3(kThreads), 0, pdl != 0,
                        static_cast<cudaStream_t>(stream), r));
}
