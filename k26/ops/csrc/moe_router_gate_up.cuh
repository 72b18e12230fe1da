// The one-token MoE block's first launch: router_kernel<1, GateUpArgs> (csrc/moe_router.cu includes this inside
// its namespace; not a standalone header: it uses moe_router.cu's Args, kThreads / kWarps and pdl helpers) runs
// the router and then, in the same grid, the gate/up GEMMs of the shared expert and of the chosen experts,
// writing act = bf16(silu(gate)) * up per slot for csrc/moe_w4a16.cu's down + combine launch (the second and last
// launch: issue 17 asks for <= 2 per MoE layer; the split path is router, gate/up, down + combine).
//
// Why: at one token the routed gate/up blocks waited for the router grid to complete before reading the ids
// (2026-12-01-moe_trace-h200.md: ids written at 9.2 µs, known to the gate/up blocks at 10.0), and the shared
// expert's gate/up ran in a second grid. Here every block is resident (the grid is capped like the router's
// barrier), so a block that has finished its router work takes gate/up items from a ticket counter: the
// shared expert's tiles first (they need no ids: they stream while the router's last block selects), then the
// routed tiles, whose blocks spin on the ids flag the selecting block raises once the ids are written.
//
// Bits: each item is the split path's gate/up block (csrc/moe_gemm.cuh gemm_kernel<1, 1, 8, 1, true, 3> for one
// token): the routed tile through gated_one_token, the shared tile through shared_acc<1, 1, true>, the 8 warps'
// k ranges summed in warp order, the same rounding points: act bit-identical, and so the block's output.
// Dependents (the down + combine launch, which reads the ids before its grid-dependency wait) are released
// by a block only once it has seen the ids flag (the ids written and fenced before the flag), or by its exit.
// Liveness rests on the whole grid being resident at once (resident_grid, as the router's barrier): a block spins
// only on the flag, which the selecting block — the last to arrive, so never a spinner before — raises.
//
// Barrier words at one token (Args::barrier, zero on entry and exit): [0] arrivals (last_arrival), [1] gate/up
// tickets, [3] ids flag, [4] departures; the last block to leave zeroes [1], [3] and [4].
//
// Legality: as moe_router.cu and csrc/moe_gate_up_one_token.cuh (mma.sync, plain and streaming loads, prefetch,
// atomics, griddepcontrol; 27 KB static shared memory a block, 128 registers, no spills): sm_90a and sm_120a.

#pragma once

struct GateUp {
  const uint4* w13;         // the repacked experts' gate/up [E, I/8, D/64, 32 lanes x 16 B] (csrc/moe_w4a16.cu)
  const uint32_t* s13;      // their scales [E, I/8, D/64, 16 words]
  const __nv_bfloat16* sg;  // the shared expert's gate [I, D] bf16, or null: no shared expert
  const __nv_bfloat16* su;  // its up [I, D]
  __nv_bfloat16* act;       // [topk (+ 1: the shared expert's slot), I]
  int I;                    // intermediate size (a multiple of 64): I / 8 interleaved 16-row tiles per expert
};

struct GateUpArgs : Args {
  GateUp gu;
};

constexpr int kGuTickets = 1, kGuIdsFlag = 3, kGuDepartures = 4;  // Args::barrier words (above)

// The selecting block, after select_token's writes (its closing barrier): the ids, written by warp 0, visible
// before the flag (the barrier, then a device-scope fence: cumulative).
__device__ __forceinline__ void raise_ids_flag(int* barrier) {
  if (threadIdx.x == 0) {
    __threadfence();
    atomicExch(&barrier[kGuIdsFlag], 1);
  }
}

// Every block once its router work is done (all threads): gate/up items until the tickets run out, then leave.
__device__ void gate_up_items(const GateUpArgs& a, float (*red)[4][32]) {
  __shared__ uint4 xs[k26_moe::kOneTokMaxK / 8];  // the token's x row, staged by gated_one_token
  __shared__ int s_item;
  const GateUp& g = a.gu;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
  const int T = g.I / 8, ST = g.sg != nullptr ? T : 0, total = ST + a.topk * T, KC = a.D / 64;
  const int c_begin = warp * KC / kWarps, c_end = (warp + 1) * KC / kWarps;  // gemm_kernel's split of k
  bool known = false;  // this block has seen the ids flag
  for (;;) {
    if (threadIdx.x == 0) s_item = atomicAdd(&a.barrier[kGuTickets], 1);
    __syncthreads();
    const int item = s_item;
    if (item >= total) break;
    if (item >= ST && !known) {
      if (threadIdx.x == 0) {
        while (*reinterpret_cast<volatile int*>(&a.barrier[kGuIdsFlag]) == 0) __nanosleep(32);
        __threadfence();  // acquire: the ids are read after the flag
      }
      __syncthreads();
      known = true;
      pdl_trigger();
    }
    float acc[1][1][4] = {{{0.f, 0.f, 0.f, 0.f}}};
    int slot = a.topk, tile = item;  // the shared expert's slot follows the routed ones
    if (item < ST) {
      // x in column g = 0 (the token), the other columns zero: gemm_kernel's brow for one token
      const uint4* brow[1] = {gq == 0 ? reinterpret_cast<const uint4*>(a.x) + 2 * t : nullptr};
      k26_moe::shared_acc<1, 1, true>(g.sg, g.su, a.D, tile, c_begin, c_end, brow, acc);
    } else {
      slot = (item - ST) / T, tile = (item - ST) % T;
      const int64_t e = __ldcg(a.out_ids + slot);  // written by this grid: coherent
      if (e < 0 || e >= a.E) {  // (the selection writes ids in [0, E); kept like the split path's check)
        __syncthreads();  // every thread has read s_item before thread 0 takes the next ticket
        continue;
      }
      k26_moe::gated_one_token(g.w13, g.s13, a.x, a.D, ((size_t)e * T + tile) * KC, c_begin, c_end, xs, acc[0][0]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][i][lane] = acc[0][0][i];
    __syncthreads();
    if (warp == 0 && t == 0) {  // token column 0: rows g / g + 8 are gate / up of feature tile * 8 + g
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        v[i] = 0.f;
#pragma unroll
        for (int q = 0; q < kWarps; ++q) v[i] += red[q][i][lane];  // warp order, as gemm_kernel
      }
      const float gate = k26_moe::bf16_round(v[0]), up = k26_moe::bf16_round(v[2]);
      const float act = k26_moe::bf16_round(gate / (1.f + __expf(-gate)));
      g.act[(size_t)slot * g.I + tile * 8 + gq] = __float2bfloat16(act * up);
    }
    __syncthreads();  // red, xs and s_item are free for the next item
  }
  if (threadIdx.x == 0 && atomicAdd(&a.barrier[kGuDepartures], 1) == (int)gridDim.x - 1) {
    atomicExch(&a.barrier[kGuTickets], 0);  // the last to leave: no block takes a ticket any more
    atomicExch(&a.barrier[kGuIdsFlag], 0);
    atomicExch(&a.barrier[kGuDepartures], 0);
  }
}
