// MLA tree attention: both verify tiles in one launch, chosen per sequence on the device by its length
// (-DK26_ATTN_UNION, an A/B side). The wide tile (csrc/mla_tree_attn_wide.cuh) wins where a split streams
// many keys and loses where its fixed cost dominates (H100, 2026-12-06-attn-wide-tile-session28-h100.md: N = 16
// at 128K 219 -> 184 µs, N = 64 at 32K 209 -> 184, but N = 16 at 4K 19.5 -> 24.7); a graph serves every context
// length and the host never sees one, so the choice is made here, per sequence: a sequence of T live keys runs
// the wide body when T >= wide_from (the wide layout's splits x kUnionKeysPerSplit), else the 32-row body.
//
// The grid is the 32-row layout's (RT x S x B); a wide sequence maps the block's linear index onto the wide
// layout (RT_w x S_w <= RT x S, S_w chosen so), the blocks past it leave. The two layouts have their own
// workspace regions and merge barriers (mla_tree_attn.cu: Layout), so sequences of one call may take
// different bodies; every barrier's protocol is the same whichever call used it last.
//
// Legality: as its two bodies (mma.sync, ldmatrix, cp.async, bar.sync with a count, griddepcontrol, atomics);
// shared memory the larger of the two (<= 99 KB): sm_90a and sm_120a.

#pragma once

#include "mla_tree_attn_kernel.cuh"
#include "mla_tree_attn_wide.cuh"

namespace k26_attn {

// Keys a wide split must stream before the wide body wins (measured: ~500 level, ~2,000 a win, ~250 a loss).
#ifndef K26_ATTN_UNION_KEYS
#define K26_ATTN_UNION_KEYS 1024
#endif
constexpr int kUnionKeysPerSplit = K26_ATTN_UNION_KEYS;
constexpr size_t kUnionSmem = Cfg<2>::SMEM > WideCfg::SMEM ? Cfg<2>::SMEM : WideCfg::SMEM;

// p: the 32-row layout (the grid's); pw: the wide one (its RT, S_max, min_keys and workspace region).
template <bool ROPE>
static __global__ void __launch_bounds__(THREADS, 1)
    tree_attn_union_kernel(Params p, Rotary rot, Params pw, int wide_from) {
  const int b = blockIdx.z;
  if (live_keys(p, static_cast<int>(p.prefix[b])) < wide_from) {
    tree_attn_body<2, ROPE>(p, rot, blockIdx.x, blockIdx.y, b);
    return;
  }
  const int linear = blockIdx.y * gridDim.x + blockIdx.x;
  const int rt = linear % pw.RT, split = linear / pw.RT;
  if (split < pw.S_max) tree_attn_wide_body<ROPE>(pw, rot, rt, split, b);
}

}  // namespace k26_attn
