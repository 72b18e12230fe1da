"""Front door of the fused INT4 MoE kernel: `torch.ops.k26.moe_w4a16_repacked` over the repacked layout
(k26/ops/moe_layout.py; CUDA kernel on GPU, the pure-torch reference elsewhere), the routing table's torch
reference, and input checks before any launch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from . import pdl
from .moe_layout import unrepack, w13_row_order
from .reference import capturing, expert_mlp, moe_combine

SPLIT_DOWN = False  # read at launch (so at capture), like pdl.ENABLED: see split_down()
# Without a routing table, where the one-launch down + combine serves (groups_from_ids): the GEMMs group the
# pairs from the ids themselves (csrc/moe_gemm.cuh group_from_ids, the down + combine's own table) instead of
# a routing launch, and the model's router writes no table. Same bits. Up to GROUPS_FROM_IDS_MAX_PAIRS pairs:
# measured on an H100 (bench_moe --block, TP8 shapes, 2026-12-06-moe-groups-tree-heap-session30-h100.md), 2
# tokens 40.9 -> 38.4 µs uniform, 32.5 -> 29.0 skewed (the router's table build, ~3.6 µs, off the path), but
# from 4 tokens slower (the count and scan in every gate/up block, wave after wave: 16 tokens 115.3 -> 117.7,
# the verify N = 16 step 7.21 -> 7.29 ms). Read at launch, like SPLIT_DOWN; the kernels take up to 512 pairs.
GROUPS_FROM_IDS = True
GROUPS_FROM_IDS_MAX_PAIRS = 16
# The routing kernel's shared memory without an opt-in: 3 ints an expert (csrc/moe_route.cuh) beside its 520
# static bytes within 48 KB (4,052; 4,096 was claimed: 4,053-4,096 failed at launch with a RuntimeError).
MAX_EXPERTS = 4000
# The kernels' limits on that path (csrc/moe_down_combine.cuh kDownCombineMaxSlots / kDownCombineMaxChunks,
# csrc/moe_gemm.cuh kOwnMaxPairs / kOwnMaxExperts); the kernel checks them again, routing itself past them.
DOWN_COMBINE_MAX_SLOTS, DOWN_COMBINE_MAX_INTER, OWN_MAX_PAIRS, OWN_MAX_EXPERTS = 576, 256, 512, 512


@contextlib.contextmanager
def split_down() -> Iterator[None]:
    """Run the down GEMM and the combine as two launches where the one-launch down + combine would serve
    (csrc/moe_down_combine.cuh; the same bits): for the A/B in profiling/bench_moe.py and the bit test."""
    global SPLIT_DOWN
    before, SPLIT_DOWN = SPLIT_DOWN, True
    try:
        yield
    finally:
        SPLIT_DOWN = before


def pick_nt(pairs: int, experts: int) -> int:
    """Token columns per expert group (8 per mma n-tile): wider only when experts see many tokens."""
    per_expert = pairs / experts
    return 1 if per_expert < 8 else 2 if per_expert < 16 else 4


def groups_from_ids(M: int, topk: int, E: int, D: int, inter: int, shared: bool) -> bool:
    """Whether the op, given no table, groups M tokens' pairs in its GEMMs from the ids (csrc/moe_w4a16.cu
    `own`): more than one token and at most GROUPS_FROM_IDS_MAX_PAIRS pairs, one 8-token column tile per
    group, the one-launch down + combine's limits (at most 576 routed + shared slots, I <= 256, an even number
    of 16-row output tiles), <= 512 experts."""
    P, S = M * topk, M if shared else 0
    return (
        GROUPS_FROM_IDS
        and not SPLIT_DOWN
        and M > 1
        and pick_nt(P, E) == 1
        and P + S <= DOWN_COMBINE_MAX_SLOTS
        and P <= min(GROUPS_FROM_IDS_MAX_PAIRS, OWN_MAX_PAIRS)
        and E <= OWN_MAX_EXPERTS
        and inter <= DOWN_COMBINE_MAX_INTER
        and (D // 16) % 2 == 0
    )


def route_table_groups(M: int, topk: int, E: int, nt: int, shared: bool) -> int:
    """Upper bound on the routing table's groups (csrc/moe_route.cuh: route_groups)."""
    P, S, gt = M * topk, M if shared else 0, 8 * nt
    return min(P, E) + P // gt + 1 + (S + gt - 1) // gt


def route_table_size(M: int, topk: int, E: int, nt: int, shared: bool) -> int:
    """int32 elements of the routing table: count, sorted slots, then expert / start / len per group."""
    return 1 + M * topk + (M if shared else 0) + 3 * route_table_groups(M, topk, E, nt, shared)


def route_table(ids_TK: torch.Tensor, E: int, nt: int, shared: bool) -> torch.Tensor:
    """The routing table of csrc/moe_route.cuh in torch (no host sync): pairs grouped by expert in groups of
    8·nt tokens, the shared expert's groups (id E, every token) first, then the experts in order. The kernels
    order the pairs of one expert arbitrarily (this takes them in pair order) and leave the slots of ids
    outside [0, E) unwritten (this puts those pairs there)."""
    M, K = ids_TK.shape
    P, S, gt = M * K, M if shared else 0, 8 * nt
    G, SG = route_table_groups(M, K, E, nt, shared), (S + gt - 1) // gt
    dev = ids_TK.device
    key = ids_TK.reshape(-1).long()
    key = torch.where((key >= 0) & (key < E), key, E)
    # scatter_add, not bincount: on CUDA bincount reads its input's max back to the host
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    cursor = torch.cumsum(counts, 0) - counts
    groups = (counts + gt - 1) // gt
    gend = torch.cumsum(groups, 0)
    gi = torch.arange(G, device=dev)
    gr = gi - SG  # routed group index
    e = torch.searchsorted(gend, gr, right=True).clamp(max=E - 1)
    j = gr - (gend[e] - groups[e])
    is_shared, is_routed = gi < SG, (gr >= 0) & (gr < gend[-1])
    zero = torch.zeros_like(gi)
    expert = torch.where(is_shared, E, torch.where(is_routed, e, zero))
    start = torch.where(is_shared, P + gi * gt, torch.where(is_routed, cursor[e] + j * gt, zero))
    length = torch.where(
        is_shared,
        torch.clamp(S - gi * gt, max=gt),
        torch.where(is_routed, torch.clamp(counts[e] - j * gt, max=gt), zero),
    )
    n = torch.clamp(gend[-1] + SG, max=G).reshape(1)
    slots = torch.cat([torch.argsort(key, stable=True), torch.arange(P, P + S, device=dev)])
    return torch.cat([n, slots, expert, start, length]).to(torch.int32)


def repacked_reference(
    x, w13, s13, w2, s2, topk_ids, topk_weights, shared_gate=None, shared_up=None, shared_down=None
):
    """Unrepack only the experts the batch touches, then the plain per-expert reference; the shared expert
    (bf16) is added after the routed sum is rounded, as `MoE.forward` does with a separate MLP."""
    inter = w13.shape[1] * 8
    order = w13_row_order(inter)

    def deq(q, s):
        return (q.float() * s.float().repeat_interleave(32, -1)).to(s.dtype).to(x.dtype)

    def weights(e: int):
        q13, sc13 = unrepack(w13[e : e + 1], s13[e : e + 1], order)
        q2, sc2 = unrepack(w2[e : e + 1], s2[e : e + 1])
        w = deq(q13[0], sc13[0])
        return w[:inter], w[inter:], deq(q2[0], sc2[0])

    out = moe_combine(x, topk_ids, topk_weights, weights)
    if shared_gate is not None:
        out = out + expert_mlp(x, shared_gate, shared_up, shared_down)
    return out


@torch.library.custom_op("k26::moe_w4a16_repacked", mutates_args=())
def moe_w4a16_repacked(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared_gate: torch.Tensor | None = None,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed int4 experts plus, if given, the bf16 shared expert [I, D], [I, D], [D, I] in the same grids.
    `table`: the routing table of these ids (csrc/moe_route.cuh, `route_table(topk_ids, E, pick_nt(M * topk,
    E), shared given)`), so the kernel skips its own routing launch; the reference ignores it."""
    shared = (shared_gate, shared_up, shared_down)
    # (the reference indexes with them: an IndexError, or -1 the last expert)
    check_ids(topk_ids, w13.shape[0])
    return repacked_reference(x, w13, s13, w2, s2, topk_ids, topk_weights, *shared)


@moe_w4a16_repacked.register_fake
def _(
    x,
    w13,
    s13,
    w2,
    s2,
    topk_ids,
    topk_weights,
    shared_gate=None,
    shared_up=None,
    shared_down=None,
    table=None,
):
    return x.new_empty(x.shape[0], w13.shape[2] * 64)


def check_ids(ids: torch.Tensor, E: int, op: str = "moe_w4a16_repacked") -> None:
    """Outside a capture, every expert id in [0, E) (a ValueError naming the first that is not). Inside one
    the kernel drops out-of-range ids safely, and a check would be kernels in every replay."""
    if capturing():
        return
    bad = (ids < 0) | (ids >= E)
    if bool(bad.any()):
        raise ValueError(f"{op}: topk_ids holds {ids[bad][0].item()}, outside [0, {E})")


def check_inputs(x, w13, s13, w2, s2, topk_ids, topk_weights, shared=(None, None, None), table=None):
    """Every shape/dtype/device problem as a ValueError naming the argument, before any launch.
    Returns M, D, I, E, topk."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"moe_w4a16_repacked: {msg}")

    need(
        x.dim() == 2 and x.dtype == torch.bfloat16,
        f"x must be 2-D bf16 [M, D], got {x.dtype} {list(x.shape)}",
    )
    M, D = x.shape
    need(
        w13.dim() == 5 and w13.dtype == torch.int32 and w13.shape[3:] == (32, 4),
        f"w13 must be int32 [E, I/8, D/64, 32, 4], got {w13.dtype} {list(w13.shape)}",
    )
    E, I = w13.shape[0], w13.shape[1] * 8
    need(D % 64 == 0 and I % 64 == 0, f"hidden D={D} and intermediate I={I} must be multiples of 64")
    need(E <= MAX_EXPERTS, f"E={E} experts exceeds the routing kernel's {MAX_EXPERTS}")
    need(w13.shape[2] * 64 == D, f"w13 holds D={w13.shape[2] * 64} but x has D={D}")
    need(
        s13.shape == (E, I // 8, D // 64, 16, 2) and s13.dtype == torch.bfloat16,
        f"s13 must be bf16 {[E, I // 8, D // 64, 16, 2]}, got {s13.dtype} {list(s13.shape)}",
    )
    need(
        w2.shape == (E, D // 16, I // 64, 32, 4) and w2.dtype == torch.int32,
        f"w2 must be int32 {[E, D // 16, I // 64, 32, 4]}, got {w2.dtype} {list(w2.shape)}",
    )
    need(
        s2.shape == (E, D // 16, I // 64, 16, 2) and s2.dtype == torch.bfloat16,
        f"s2 must be bf16 {[E, D // 16, I // 64, 16, 2]}, got {s2.dtype} {list(s2.shape)}",
    )
    need(
        topk_ids.dim() == 2 and topk_ids.shape[0] == M and not topk_ids.is_floating_point(),
        f"topk_ids must be integer [M={M}, topk], got {topk_ids.dtype} {list(topk_ids.shape)}",
    )
    need(
        topk_weights.shape == topk_ids.shape and topk_weights.is_floating_point(),
        f"topk_weights must be float {list(topk_ids.shape)}, "
        f"got {topk_weights.dtype} {list(topk_weights.shape)}",
    )
    named = [
        ("x", x),
        ("w13", w13),
        ("s13", s13),
        ("w2", w2),
        ("s2", s2),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
    ]
    if any(t is not None for t in shared):
        shapes = ((I, D), (I, D), (D, I))
        for name, t, shape in zip(("shared_gate", "shared_up", "shared_down"), shared, shapes, strict=True):
            need(
                t is not None and t.dtype == torch.bfloat16 and tuple(t.shape) == shape,
                f"{name} must be bf16 {list(shape)} (the shared expert as wide as a routed one), got "
                f"{None if t is None else (t.dtype, list(t.shape))}",
            )
            named.append((name, t))
    if table is not None:
        K, has_shared = topk_ids.shape[1], shared[0] is not None
        n = route_table_size(M, K, E, pick_nt(M * K, E), has_shared)
        need(
            table.dim() == 1 and table.dtype == torch.int32 and table.numel() == n,
            f"table must be int32 [{n}] (route_table with nt=pick_nt({M * K}, {E}), "
            f"shared={has_shared}), got {table.dtype} {list(table.shape)}",
        )
        named.append(("table", table))
    for name, t in named:
        need(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
        need(t.is_contiguous(), f"{name} must be contiguous")
    return M, D, I, E, topk_ids.shape[1]


@functools.cache  # once per process, like build.library
def _library():
    """The kernel library with this op's ctypes signatures (csrc/moe_w4a16.cu)."""
    import ctypes

    from .build import library

    lib = library()
    lib.k26_moe_w4a16_workspace.restype = ctypes.c_size_t
    lib.k26_moe_w4a16_workspace.argtypes = [ctypes.c_int] * 7
    lib.k26_moe_w4a16.restype = ctypes.c_int
    # x, w13, s13, w2, s2, ids, topw, out, workspace; M, D, I, E, topk, nt; shared gate/up/down, table;
    # pdl; stream
    ptrs, ints = [ctypes.c_void_p] * 9, [ctypes.c_int] * 6
    lib.k26_moe_w4a16.argtypes = [*ptrs, *ints, *[ctypes.c_void_p] * 4, ctypes.c_int, ctypes.c_void_p]
    return lib


MAX_TOKENS = 65535  # CUDA's grid-y limit: csrc/moe_w4a16.cu launches the combine with gridDim.y = M


def _moe_cuda(
    x,
    w13,
    s13,
    w2,
    s2,
    topk_ids,
    topk_weights,
    shared_gate=None,
    shared_up=None,
    shared_down=None,
    table=None,
):
    shared = (shared_gate, shared_up, shared_down)
    M, D, I, E, topk = check_inputs(x, w13, s13, w2, s2, topk_ids, topk_weights, shared, table)
    out = torch.empty(M, D, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return out
    if M > MAX_TOKENS:  # a long prefill: the combine kernel's grid has one row of blocks per token (pieces
        # route themselves: the table is of all M tokens)
        for a in range(0, M, MAX_TOKENS):
            b = min(M, a + MAX_TOKENS)
            out[a:b] = _moe_cuda(x[a:b], w13, s13, w2, s2, topk_ids[a:b], topk_weights[a:b], *shared)
        return out
    ids = topk_ids.to(torch.int64).contiguous()
    check_ids(ids, E)
    w = topk_weights.to(torch.float32).contiguous()
    lib = _library()
    nt = pick_nt(M * topk, E)
    has_shared = shared_gate is not None
    own = table is None and groups_from_ids(M, topk, E, D, I, has_shared)
    ws = torch.empty(
        lib.k26_moe_w4a16_workspace(M, D, I, E, topk, nt, int(has_shared)), dtype=torch.uint8, device=x.device
    )
    sp = [t.data_ptr() if has_shared else None for t in shared]
    err = lib.k26_moe_w4a16(
        x.data_ptr(),
        w13.data_ptr(),
        s13.data_ptr(),
        w2.data_ptr(),
        s2.data_ptr(),
        ids.data_ptr(),
        w.data_ptr(),
        out.data_ptr(),
        ws.data_ptr(),
        M,
        D,
        I,
        E,
        topk,
        nt,
        *sp,
        None if table is None else table.data_ptr(),
        # flags (csrc/moe_w4a16.cu): PDL (the shared expert's gate/up blocks overlap the routing), split down,
        # groups from the ids
        int(pdl.ENABLED) | (2 if SPLIT_DOWN else 0) | (4 if own else 0),
        torch.cuda.current_stream(x.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"moe_w4a16_repacked: CUDA launch failed with error {err}")
    return out


moe_w4a16_repacked.register_kernel("cuda")(_moe_cuda)
