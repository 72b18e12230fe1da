// -DK26_ROUTER_POLL's one-token router (csrc/moe_router.cu includes this under the switch; see the VARIANTS
// entry in k26/ops/build.py). Not a standalone header: it uses moe_router.cu's Args, phase helpers and
// constants defined above its include point.
#pragma once

// -DK26_ROUTER_POLL: one token (n_group 1, topk <= 8, E <= 512, <= 8 k ranges) without the arrival count.
// Phase-1 blocks store each partial as (1 << 32 | its bits) into kernel-owned slots (relaxed 64-bit stores,
// single-copy atomic: the value is its own flag) and leave: no fence, no atomic. Block 0, after its own
// item, loads its experts' slots until every one is full (~one L2 round trip after the last store lands,
// where router_kernel's last block spends four: fence, count, the count's reset + fence, the gather), empties
// them for the next launch and selects from registers: each warp's top-8 by redux.sync picks (a lane's two
// keys presorted: the winner shifts, no rescan), the top-k of the 64 candidates by ranks (4 threads count
// the candidates that beat one), the weights' sum from shared memory. Same sums, keys, candidates and tie
// order as router_kernel<1>: the same bits. The slots are one set per device: one router launch at a time
// (one stream); a launch stores only after its PDL wait, i.e. after the previous one (resets included).
constexpr int kPollKs = 8, kPollE = 2 * kThreads;
static_assert(kThreads == 4 * kWarps * kFastTopk, "4 threads rank each of the warps' candidates");
__device__ unsigned long long g_router_slots[kPollKs * kPollE];  // [k range][expert]; zero: empty

__device__ __forceinline__ void st_relaxed(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_relaxed(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];\n" : "=l"(v) : "l"(p));
  return v;
}

// logits_phase<1> for one token, the partials into the slots.
__device__ void logits_phase_poll(const Args& a, float (*red)[4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_tiles = (a.E + 15) / 16, kc = a.D / 64, items = row_tiles * a.ks;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int rt = item % row_tiles, ks = item / row_tiles;
    const int cb = ks * a.chunks_per_ks, ce = min(kc, cb + a.chunks_per_ks), n = ce - cb;
    float acc[1][4];
    dot_tile<1>(a, 0, rt * 16, cb + warp * n / kWarps, cb + (warp + 1) * n / kWarps, acc);
    TRACE(1);
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][i][lane] = acc[0][i];
    __syncthreads();
    pdl_wait();  // before any slot store (a warp without k chunks never waited): the last launch emptied them
    if (threadIdx.x < 4 * 32) {
      const int l = threadIdx.x & 31, i = threadIdx.x >> 5, row = rt * 16 + (l >> 2) + 8 * (i >> 1);
      if (row < a.E && (l & 3) == 0 && (i & 1) == 0) {  // token 0's values
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += red[w][i][l];  // router_kernel's order
        st_relaxed(g_router_slots + ks * kPollE + row, 1ull << 32 | __float_as_uint(s));
      }
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads, 2) router_poll_kernel(Args a) {
  __shared__ float red[kWarps][4][32];
  __shared__ float score[kPollE];
  __shared__ unsigned long long cand[kWarps * kFastTopk];  // key << 32 | 63 - tie order (below)
  __shared__ int cand_id[kWarps * kFastTopk];
  __shared__ int sel_id[kFastTopk];
  __shared__ float sel_score[kFastTopk];
  TRACE(0);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  float bias[2];  // block 0's experts t and t + 256, in flight during phase 1
#pragma unroll
  for (int j = 0; j < 2; ++j) bias[j] = blockIdx.x == 0 && t + j * kThreads < a.E ? __ldg(a.bias + t + j * kThreads) : 0.f;
  logits_phase_poll(a, red);
  TRACE(2);
  pdl_wait();
  pdl_trigger();
  if (blockIdx.x != 0) return;
  // This thread's slots (k range k, expert t + 256 j: bit 2k + j), loaded until each is full, then emptied.
  uint32_t need = 0;
#pragma unroll
  for (int k = 0; k < kPollKs; ++k)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (k < a.ks && t + j * kThreads < a.E) need |= 1u << (2 * k + j);
  const uint32_t all = need;
  unsigned long long* slot = g_router_slots + t;
  float v[kPollKs][2];
  while (need) {
    unsigned long long r[kPollKs][2];
#pragma unroll
    for (int k = 0; k < kPollKs; ++k)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (need >> (2 * k + j) & 1) r[k][j] = ld_relaxed(slot + k * kPollE + j * kThreads);
    uint32_t got = 0;
#pragma unroll
    for (int k = 0; k < kPollKs; ++k)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if ((need >> (2 * k + j) & 1) && (r[k][j] >> 32)) {
          v[k][j] = __uint_as_float((uint32_t)r[k][j]);
          got |= 1u << (2 * k + j);
        }
    need &= ~got;
  }
#pragma unroll
  for (int k = 0; k < kPollKs; ++k)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (all >> (2 * k + j) & 1) st_relaxed(slot + k * kPollE + j * kThreads, 0ull);
  TRACE(3);
  uint32_t key[2];
  int id[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int e = t + j * kThreads;
    float l = 0.f;
#pragma unroll
    for (int k = 0; k < kPollKs; ++k)
      if (all >> (2 * k + j) & 1) l += v[k][j];  // k order: router_kernel's sums
    key[j] = 0u, id[j] = e;
    if (e < a.E) {
      const float s = 1.f / (1.f + expf(-l));
      score[e] = s;
      const float c = s + bias[j];
      key[j] = order_key(isnan(c) ? -INFINITY : c);
    }
  }
  TRACE(4);
  // Each warp's top-8 in warp_picks' order: the best key, ties to the lowest lane, then to its lower j. The
  // second round (topk_fast: warp 0, lane l holding candidates l and l + 32) breaks a tie between candidates
  // c by (c % 32, c / 32): that order rides below the key, so one 64-bit compare ranks.
  if (key[1] > key[0]) {
    const uint32_t k = key[0];
    const int i = id[0];
    key[0] = key[1], id[0] = id[1], key[1] = k, id[1] = i;
  }
  uint32_t below;  // the lanes below this one
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(below));
#pragma unroll
  for (int k = 0; k < kFastTopk; ++k) {
    const uint32_t top = __reduce_max_sync(0xffffffffu, key[0]);
    const uint32_t holders = __ballot_sync(0xffffffffu, key[0] == top);
    if (key[0] == top && !(holders & below)) {
      const int c = warp * kFastTopk + k;
      cand[c] = (unsigned long long)top << 32 | (63 - (c & 31) * 2 - (c >> 5));
      cand_id[c] = id[0];
      key[0] = key[1], id[0] = id[1], key[1] = 0u;
    }
  }
  __syncthreads();
  TRACE(7);
  {  // candidate c's rank: the candidates that beat it (topk_fast's second round picks in this order)
    const int c = t >> 2, q = t & 3;
    const unsigned long long mine = cand[c];
    int rank = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) rank += cand[16 * q + i] > mine;
    rank += __shfl_xor_sync(0xffffffffu, rank, 1);
    rank += __shfl_xor_sync(0xffffffffu, rank, 2);
    if (q == 0 && rank < a.topk) sel_id[rank] = cand_id[c], sel_score[rank] = score[cand_id[c]];
  }
  __syncthreads();
  TRACE(8);
  if (warp == 0) {
    float sum = 0.f;  // in k order, as write_choice
#pragma unroll
    for (int k = 0; k < kFastTopk; ++k)
      if (k < a.topk) sum += sel_score[k];
    if (lane < a.topk) {
      const float s = sel_score[lane];
      a.out_w[lane] = (a.renormalize ? s / (sum + 1e-20f) : s) * a.scale;
      a.out_ids[lane] = sel_id[lane];
    }
  }
  TRACE(5);
  if (a.table == nullptr) return;
  __syncthreads();
  __shared__ int route_sm[3 * kMaxE];
  build_route_table([&](int p) { return __ldcg(a.out_ids + p); }, a.topk, a.E, a.table_gt, a.table_S,
                    route_table_at(a.table, a.topk, a.table_S, a.E, a.table_gt), route_sm);
  TRACE(11);
}

