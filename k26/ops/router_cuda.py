"""Front door of the fused MoE router (csrc/moe_router.cu): `torch.ops.k26.moe_router`, input checks
before any launch, and the CUDA kernel (the pure-torch reference `reference.moe_router` elsewhere).

The op returns what `moe_w4a16_repacked` takes: fp32 weights [M, topk], int64 ids [M, topk] and, with
`table_nt` > 0, the routing table of those ids (csrc/moe_route.cuh; `moe_cuda.route_table` is its torch
reference) for groups of 8·table_nt tokens, so the expert op runs no routing launch of its own.
`counters` is the kernel's arrival-counter scratch: int32 [COUNTERS], zero before and after every call;
its owner (the model's `Router`) allocates it once with `router_counters`. The reference ignores it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import reference
from .moe_cuda import route_table, route_table_size

COUNTERS = 1 + 128  # csrc/moe_router.cu: kCounters
MAX_EXPERTS, MAX_TOPK, MAX_GROUPS = 512, 32, 32  # csrc/moe_router.cu: kMaxE, kMaxTopk, kMaxGroups
MAX_TOKENS = 4096  # per launch (kMaxMTiles token tiles of 32); more tokens run in pieces


def router_counters(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def _table(ids: torch.Tensor, E: int, table_nt: int, table_shared: bool) -> torch.Tensor:
    if table_nt == 0:
        return ids.new_empty(0, dtype=torch.int32)
    return route_table(ids, E, table_nt, table_shared)


@torch.library.custom_op("k26::moe_router", mutates_args=())
def moe_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    counters: torch.Tensor,
    n_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool,
    scale: float,
    table_nt: int = 0,
    table_shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w, ids = reference.moe_router(x, weight, bias, n_group, topk_group, topk, renormalize, scale)
    return w, ids, _table(ids, weight.shape[0], table_nt, table_shared)


@moe_router.register_fake
def _(
    x, weight, bias, counters, n_group, topk_group, topk, renormalize, scale, table_nt=0, table_shared=False
):
    M, E = x.shape[0], weight.shape[0]
    n = route_table_size(M, topk, E, table_nt, table_shared) if table_nt else 0
    return (
        x.new_empty(M, topk, dtype=torch.float32),
        x.new_empty(M, topk, dtype=torch.int64),
        x.new_empty(n, dtype=torch.int32),
    )


def check_inputs(
    x, weight, bias, counters, n_group: int, topk_group: int, topk: int, table_nt: int = 0
) -> tuple[int, int, int]:
    """Every shape/dtype/device problem of the CUDA path as a ValueError naming the argument."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"moe_router: {msg}")

    need(
        x.dim() == 2 and x.dtype == torch.bfloat16,
        f"x must be 2-D bf16 [M, D], got {x.dtype} {list(x.shape)}",
    )
    M, D = x.shape
    need(
        weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.shape[1] == D,
        f"weight must be bf16 [E, D={D}], got {weight.dtype} {list(weight.shape)}",
    )
    E = weight.shape[0]
    need(0 < E <= MAX_EXPERTS, f"E={E} experts: the kernel holds 1..{MAX_EXPERTS}")
    need(
        bias.shape == (E,) and bias.dtype == torch.float32,
        f"bias must be fp32 [{E}], got {bias.dtype} {list(bias.shape)}",
    )
    need(
        counters.shape == (COUNTERS,) and counters.dtype == torch.int32,
        f"counters must be int32 [{COUNTERS}] (router_counters)",
    )
    need(0 < topk <= min(E, MAX_TOPK), f"topk={topk} must be in [1, {min(E, MAX_TOPK)}]")
    need(
        0 < n_group <= MAX_GROUPS and E % n_group == 0,
        f"n_group={n_group} must divide E={E} and be <= {MAX_GROUPS}",
    )
    need(0 < topk_group <= n_group, f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    need(n_group == 1 or E // n_group >= 2, f"groups of {E // n_group} expert: group scores sum the best two")
    need(table_nt in (0, 1, 2, 4), f"table_nt={table_nt} must be 0 (no table), 1, 2 or 4 (moe_cuda.pick_nt)")
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("counters", counters)):
        need(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
        need(t.is_contiguous(), f"{name} must be contiguous")
    return M, D, E


@functools.cache  # once per process, like build.library
def _library() -> ctypes.CDLL:
    """The kernel library with this op's ctypes signatures (csrc/moe_router.cu)."""
    from .build import library

    lib = library()
    lib.k26_moe_router_counters.restype = ctypes.c_int
    if lib.k26_moe_router_counters() != COUNTERS:
        raise RuntimeError("moe_router: COUNTERS does not match the kernel library's kCounters")
    lib.k26_moe_router_workspace.restype = ctypes.c_size_t
    lib.k26_moe_router_workspace.argtypes = [ctypes.c_int] * 3
    lib.k26_moe_router.restype = ctypes.c_int
    # x, weight, bias, counters, workspace, out_w, out_ids, table; M, D, E, n_group, topk_group, topk,
    # renormalize, table_nt, table_shared
    ptrs, ints = [ctypes.c_void_p] * 8, [ctypes.c_int] * 9
    lib.k26_moe_router.argtypes = [*ptrs, *ints, ctypes.c_float, ctypes.c_void_p]
    return lib


@moe_router.register_kernel("cuda")
def _(
    x, weight, bias, counters, n_group, topk_group, topk, renormalize, scale, table_nt=0, table_shared=False
):
    M, D, E = check_inputs(x, weight, bias, counters, n_group, topk_group, topk, table_nt)
    if D % 64:  # the kernel tiles k by 64; no K2 checkpoint has such a hidden size
        w, ids = reference.moe_router(x, weight, bias, n_group, topk_group, topk, renormalize, scale)
        return w, ids, _table(ids, E, table_nt, table_shared)
    out_w = torch.empty(M, topk, dtype=torch.float32, device=x.device)
    out_ids = torch.empty(M, topk, dtype=torch.int64, device=x.device)
    one_launch = 0 < M <= MAX_TOKENS
    table = (
        torch.empty(route_table_size(M, topk, E, table_nt, table_shared), dtype=torch.int32, device=x.device)
        if table_nt and one_launch
        else None
    )
    lib = _library()
    stream = torch.cuda.current_stream(x.device).cuda_stream
    for a in range(0, M, MAX_TOKENS):  # a long prefill in pieces: the table then comes from route_table
        b = min(M, a + MAX_TOKENS)
        ws = torch.empty(lib.k26_moe_router_workspace(b - a, D, E) // 4, dtype=torch.float32, device=x.device)
        err = lib.k26_moe_router(
            x[a:b].data_ptr(),
            weight.data_ptr(),
            bias.data_ptr(),
            counters.data_ptr(),
            ws.data_ptr(),
            out_w[a:b].data_ptr(),
            out_ids[a:b].data_ptr(),
            None if table is None else table.data_ptr(),
            b - a,
            D,
            E,
            n_group,
            topk_group,
            topk,
            int(renormalize),
            table_nt,
            int(table_shared),
            scale,
            stream,
        )
        if err:
            raise RuntimeError(f"moe_router: CUDA launch failed with error {err}")
    if table is None:
        table = _table(out_ids, E, table_nt, table_shared)
    return out_w, out_ids, table
