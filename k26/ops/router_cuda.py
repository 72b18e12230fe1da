"""Front door of the fused MoE router (csrc/moe_router.cu): `torch.ops.k26.moe_router`, input checks
before any launch, and the CUDA kernel (the pure-torch reference `reference.moe_router` elsewhere).

The op returns what `moe_w4a16_repacked` takes: fp32 weights [M, topk] and int64 ids [M, topk];
`torch.ops.k26.moe_router_table` also returns the expert op's routing table of those ids (csrc/moe_route.cuh,
`moe_cuda.route_table`), built by the router kernel's last block, so the expert op runs no routing launch.
`barrier` is the kernel's grid-barrier scratch: int32 [5], zero before and after every call; its owner
(the model's `Router`) allocates it once with `router_barrier`; `moe_one_token` (moe_block_cuda) uses the same
scratch. The reference ignores it.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from . import pdl, reference
from .log import say_once
from .moe_cuda import pick_nt, route_table, route_table_size

# csrc/moe_router.cu's scratch: grid barrier (2; word 1 also moe_one_token's gate/up tickets), phase-2
# arrivals (1), moe_one_token's ids flag and departures (2)
BARRIER_INTS = 5


def router_barrier(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(BARRIER_INTS, dtype=torch.int32, device=device)


@torch.library.custom_op("k26::moe_router", mutates_args=())
def moe_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    barrier: torch.Tensor,
    n_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(x, weight, bias, barrier, n_group, topk_group, topk, kernel=False)
    return reference.moe_router(x, weight, bias, n_group, topk_group, topk, renormalize, scale)


@moe_router.register_fake
def _(x, weight, bias, barrier, n_group, topk_group, topk, renormalize, scale):
    M = x.shape[0]
    return x.new_empty(M, topk, dtype=torch.float32), x.new_empty(M, topk, dtype=torch.int64)


@torch.library.custom_op("k26::moe_router_table", mutates_args=())
def moe_router_table(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    barrier: torch.Tensor,
    n_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool,
    scale: float,
    shared: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_router` plus the routing table `moe_w4a16_repacked(..., table=)` takes for these ids: groups of
    the expert op's 8·nt tokens (nt = moe_cuda.pick_nt(M * topk, E), derived here so the two always
    agree), the shared expert's slots when `shared`. The kernel orders the pairs inside a group arbitrarily
    and leaves the groups past the count unwritten (the expert op reads neither); the reference is
    `route_table`'s order."""
    check_inputs(x, weight, bias, barrier, n_group, topk_group, topk, kernel=False)
    w, ids = reference.moe_router(x, weight, bias, n_group, topk_group, topk, renormalize, scale)
    E = weight.shape[0]
    return w, ids, route_table(ids, E, pick_nt(ids.numel(), E), shared)


@moe_router_table.register_fake
def _(x, weight, bias, barrier, n_group, topk_group, topk, renormalize, scale, shared):
    M, E = x.shape[0], weight.shape[0]
    n = route_table_size(M, topk, E, pick_nt(M * topk, E), shared)
    return (
        x.new_empty(M, topk, dtype=torch.float32),
        x.new_empty(M, topk, dtype=torch.int64),
        x.new_empty(n, dtype=torch.int32),
    )


MAX_EXPERTS, MAX_TOPK, MAX_GROUPS = 1024, 32, 32  # csrc/moe_router.cu: kMaxE, kMaxTopk, kMaxGroups


def check_inputs(
    x, weight, bias, barrier, n_group: int, topk_group: int, topk: int, kernel: bool = True
) -> tuple[int, int, int]:
    """Every shape/dtype/device problem as a ValueError naming the argument: of the CUDA path (`kernel`: bf16
    x and weight, fp32 bias, the kernel's limits, contiguous, the barrier), or of the reference's (any float
    dtypes and sizes; `barrier` unused), which ran with none (topk = 0 answered nothing)."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"moe_router: {msg}")

    bf16 = "bf16 " if kernel else ""
    need(
        x.dim() == 2 and (x.dtype == torch.bfloat16 if kernel else x.is_floating_point()),
        f"x must be 2-D {bf16 or 'float '}[M, D], got {x.dtype} {list(x.shape)}",
    )
    M, D = x.shape
    need(
        weight.dim() == 2
        and (weight.dtype == torch.bfloat16 if kernel else weight.is_floating_point())
        and weight.shape[1] == D,
        f"weight must be {bf16}[E, D={D}], got {weight.dtype} {list(weight.shape)}",
    )
    E = weight.shape[0]
    most_e, most_k, most_g = (MAX_EXPERTS, MAX_TOPK, MAX_GROUPS) if kernel else (E, E, E)
    need(0 < E <= most_e, f"E={E} experts: the kernel holds 1..{MAX_EXPERTS}")
    need(
        bias.shape == (E,) and (bias.dtype == torch.float32 if kernel else bias.is_floating_point()),
        f"bias must be {'fp32 ' if kernel else ''}[{E}], got {bias.dtype} {list(bias.shape)}",
    )
    if kernel:
        need(
            barrier.shape == (BARRIER_INTS,) and barrier.dtype == torch.int32,
            f"barrier must be int32 [{BARRIER_INTS}] (router_barrier)",
        )
    need(0 < topk <= min(E, most_k), f"topk={topk} must be in [1, {min(E, most_k)}]")
    need(
        0 < n_group <= most_g and E % n_group == 0,
        f"n_group={n_group} must divide E={E} and be <= {most_g}",
    )
    need(0 < topk_group <= n_group, f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    kept = topk_group * (E // n_group)  # (more would take experts of dropped groups, -inf, and weight them)
    need(topk <= kept, f"topk={topk} exceeds the {kept} experts of topk_group={topk_group} groups")
    need(n_group == 1 or E // n_group >= 2, f"groups of {E // n_group} expert: group scores sum the best two")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)) + (
        (("barrier", barrier),) if kernel else ()
    ):
        need(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
        need(not kernel or t.is_contiguous(), f"{name} must be contiguous")
    return M, D, E


@functools.cache  # once per process, like build.library
def _library() -> ctypes.CDLL:
    """The kernel library with this op's ctypes signatures (csrc/moe_router.cu)."""
    from .build import library

    lib = library()
    lib.k26_moe_router_workspace.restype = ctypes.c_size_t
    lib.k26_moe_router_workspace.argtypes = [ctypes.c_int] * 3
    lib.k26_moe_router.restype = ctypes.c_int
    # x, weight, bias, barrier, workspace, out_w, out_ids, table; M, D, E, n_group, topk_group, topk,
    # renormalize, table_gt, table_S; scale; pdl; stream
    ptrs, ints = [ctypes.c_void_p] * 8, [ctypes.c_int] * 9
    lib.k26_moe_router.argtypes = [*ptrs, *ints, ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    return lib


def _run(x, weight, bias, barrier, n_group, topk_group, topk, renormalize, scale, shared):
    """The CUDA kernel (or the reference for an unsupported hidden size); `shared` (bool) to build the routing
    table too (groups of the expert op's pick_nt), None for none. Returns (weights, ids, table or None)."""
    M, D, E = check_inputs(x, weight, bias, barrier, n_group, topk_group, topk)
    nt = pick_nt(M * topk, E)

    def torch_table(ids):  # the reference's table where the kernel does not run
        return None if shared is None else route_table(ids, E, nt, shared)

    if D % 64:  # the kernel tiles k by 64; no K2 checkpoint has such a hidden size
        say_once(
            __name__,
            logging.INFO,
            f"k26.moe_router: hidden size {D} (not a multiple of 64) runs the reference",
        )
        w, ids = reference.moe_router(x, weight, bias, n_group, topk_group, topk, renormalize, scale)
        return w, ids, torch_table(ids)
    out_w = torch.empty(M, topk, dtype=torch.float32, device=x.device)
    out_ids = torch.empty(M, topk, dtype=torch.int64, device=x.device)
    table, gt, S = None, 0, 0
    if shared is not None:
        table = torch.empty(route_table_size(M, topk, E, nt, shared), dtype=torch.int32, device=x.device)
        gt, S = 8 * nt, M if shared else 0
    if M == 0:
        return out_w, out_ids, torch_table(out_ids)
    lib = _library()
    ws = torch.empty(lib.k26_moe_router_workspace(M, D, E) // 4, dtype=torch.float32, device=x.device)
    err = lib.k26_moe_router(
        x.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr(),
        barrier.data_ptr(),
        ws.data_ptr(),
        out_w.data_ptr(),
        out_ids.data_ptr(),
        None if table is None else table.data_ptr(),
        M,
        D,
        E,
        n_group,
        topk_group,
        topk,
        int(renormalize),
        gt,
        S,
        scale,
        int(pdl.ENABLED),  # csrc/moe_router.cu: the first weight batch streams in under the previous kernel
        torch.cuda.current_stream(x.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"moe_router: CUDA launch failed with error {err}")
    return out_w, out_ids, table


@moe_router.register_kernel("cuda")
def _(x, weight, bias, barrier, n_group, topk_group, topk, renormalize, scale):
    return _run(x, weight, bias, barrier, n_group, topk_group, topk, renormalize, scale, None)[:2]


@moe_router_table.register_kernel("cuda")
def _(x, weight, bias, barrier, n_group, topk_group, topk, renormalize, scale, shared):
    return _run(x, weight, bias, barrier, n_group, topk_group, topk, renormalize, scale, bool(shared))
