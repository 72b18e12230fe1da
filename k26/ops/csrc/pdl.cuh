// Programmatic dependent launch, shared by the k26 kernels that use it (linear_smallm, mla_glue, moe_w4a16,
// moe_router, allreduce_fused, add_rmsnorm; mla_tree_attn sets the attribute in its own launch config): a
// kernel launched with `pdl` may start while the kernel before it on the stream still
// runs; inside it, pdl_wait() blocks until that kernel has finished and its writes are visible, and
// pdl_trigger() lets the kernel after it start early (which in turn waits before reading our outputs).
// Without the launch attribute both are no-ops.
//
// Loads around pdl_wait(): ptxas moves non-coherent loads (ld.global.nc: __ldg, "ld.global.nc.*" asm) across
// griddepcontrol.wait in either direction, coherent ones (ld.global, __ldcg / __ldcs / __ldca, cp.async) not
// (2026-12-05, SASS via scripts/sass_schedule.py). So: data an earlier kernel writes is read after the wait with
// coherent loads (an __ldg of it was hoisted above the wait in the sm_120a build of the deep tile-mode linear:
// a race), and a constant meant to be in flight across the wait needs a coherent load or cp.async too (.nc
// weight batches "before the wait" were sunk below it). tests/test_sass_schedule.py checks every kernel.
// Such data can also go through L1 (ld_after_wait below): the wait makes the earlier grids' writes visible to every
// load after it, and L1 lets the blocks sharing an SM fetch a line from L2 once (2026-12-07).
//
// Legality: griddepcontrol (sm_90 and sm_120 both have it) and cudaLaunchKernelEx.

#pragma once

#include <cuda_runtime.h>

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// 16 bytes an earlier kernel wrote, read after pdl_wait(): ld.global.ca (coherent, cached in L1), asm volatile so
// that it stays below the wait. The small-M linear's x (csrc/linear_tile.cuh ld_x) and the MoE kernels'
// activations (csrc/moe_mma.cuh ld_act).
__device__ __forceinline__ uint4 ld_after_wait(const void* p) {
  uint4 v;
  asm volatile("ld.global.ca.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// `kernel<<<grid, block, smem, st>>>(args...)`, with programmatic stream serialization when `pdl`.
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, bool pdl, cudaStream_t st,
                       Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}
