"""Front door of the one-token MoE block in two launches: `torch.ops.k26.moe_one_token`, from the normed
hidden state of one token to the block's output (before the TP all-reduce).

Launch 1 (csrc/moe_router.cu, router_kernel<1, GateUpArgs>; csrc/moe_router_gate_up.cuh): the fused router,
then in the same grid the gate/up GEMMs of the shared expert and of the chosen experts. Launch 2
(csrc/moe_w4a16.cu, k26_moe_down_one_token): the down projection of every pair and the shared expert, and the
weighted sum. The split path — `moe_router`, then `moe_w4a16_repacked` (a gate/up launch and a down + combine
launch) — computes the same bits in three launches; the specification is the reference router followed by the
expert op's reference. `barrier` is the router's scratch (`router_cuda.router_barrier`).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import pdl, reference
from .moe_cuda import check_inputs as check_experts
from .moe_cuda import repacked_reference
from .router_cuda import _library as router_library  # k26_moe_router_workspace's signature
from .router_cuda import check_inputs as check_router

MAX_HIDDEN = 7168  # csrc/moe_gate_up_one_token.cuh kOneTokMaxK: the staged x row
MAX_TOPK = 8  # csrc/moe_one_token.cuh kDownOneTokPairs: a warp per pair in the down + combine launch


def serves(M: int, D: int, topk: int) -> bool:
    """Whether the two-launch kernels take this block (one token; else the split path)."""
    return M == 1 and D % 64 == 0 and D <= MAX_HIDDEN and topk <= MAX_TOPK


@torch.library.custom_op("k26::moe_one_token", mutates_args=())
def moe_one_token(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    barrier: torch.Tensor,
    n_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool,
    scale: float,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    shared_gate: torch.Tensor | None = None,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE block of one token x [1, D]: router (weight [E, D] bf16, bias [E] fp32 and the routing
    parameters of `moe_router`), repacked int4 experts, optional bf16 shared expert."""
    w, ids = reference.moe_router(x, weight, bias, n_group, topk_group, topk, renormalize, scale)
    return repacked_reference(x, w13, s13, w2, s2, ids, w, shared_gate, shared_up, shared_down)


@moe_one_token.register_fake
def _(
    x,
    weight,
    bias,
    barrier,
    n_group,
    topk_group,
    topk,
    renormalize,
    scale,
    w13,
    s13,
    w2,
    s2,
    shared_gate=None,
    shared_up=None,
    shared_down=None,
):
    return x.new_empty(x.shape[0], x.shape[1])


@functools.cache  # once per process, like build.library
def _library() -> ctypes.CDLL:
    """The kernel library with the two launches' ctypes signatures (and the router's)."""
    lib = router_library()
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.k26_moe_router_gate_up.restype = ctypes.c_int
    # x, weight, bias, barrier, workspace, out_w, out_ids; D, E, n_group, topk_group, topk, renormalize;
    # scale; w13, s13, shared gate, shared up, act; I; pdl; stream
    lib.k26_moe_router_gate_up.argtypes = [*[p] * 7, *[i] * 6, ctypes.c_float, *[p] * 5, i, i, p]
    lib.k26_moe_down_one_token.restype = ctypes.c_int
    # act, w2, s2, ids, weights, out; D, I, E, topk; shared down; pdl; stream
    lib.k26_moe_down_one_token.argtypes = [*[p] * 6, *[i] * 4, p, i, p]
    return lib


def check_inputs(x, weight, bias, barrier, n_group, topk_group, topk, w13, s13, w2, s2, shared) -> tuple:
    """Every problem of the two launches' inputs as a ValueError naming the argument, before any launch (the
    router's and the expert op's checks, one token, the two agreeing on E). Returns D, E, I and the (empty)
    weights and ids buffers the router kernel writes. Launches nothing itself (a fill or copy here would be a
    kernel between the previous layer's and the router's)."""
    M, D, E = check_router(x, weight, bias, barrier, n_group, topk_group, topk)
    if not serves(M, D, topk):
        raise ValueError(
            f"moe_one_token: one token, hidden size a multiple of 64 up to {MAX_HIDDEN} and topk <= "
            f"{MAX_TOPK} (got M={M}, D={D}, topk={topk}); other blocks take moe_router + moe_w4a16_repacked"
        )
    ids = torch.empty(M, topk, dtype=torch.int64, device=x.device)
    w = torch.empty(M, topk, dtype=torch.float32, device=x.device)
    _, _, I, E_experts, _ = check_experts(x, w13, s13, w2, s2, ids, w, shared)
    if E_experts != E:
        raise ValueError(f"moe_one_token: the router weight scores E={E} experts, w13 holds {E_experts}")
    return D, E, I, w, ids


@moe_one_token.register_kernel("cuda")
def _(
    x,
    weight,
    bias,
    barrier,
    n_group,
    topk_group,
    topk,
    renormalize,
    scale,
    w13,
    s13,
    w2,
    s2,
    shared_gate=None,
    shared_up=None,
    shared_down=None,
):
    shared = (shared_gate, shared_up, shared_down)
    checked = check_inputs(x, weight, bias, barrier, n_group, topk_group, topk, w13, s13, w2, s2, shared)
    D, E, I, out_w, out_ids = checked
    M, dev = 1, x.device
    has_shared = shared[0] is not None
    lib = _library()
    ws = torch.empty(lib.k26_moe_router_workspace(M, D, E) // 4, dtype=torch.float32, device=dev)
    act = torch.empty(topk + int(has_shared), I, dtype=torch.bfloat16, device=dev)
    out = torch.empty(M, D, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    err = lib.k26_moe_router_gate_up(
        x.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr(),
        barrier.data_ptr(),
        ws.data_ptr(),
        out_w.data_ptr(),
        out_ids.data_ptr(),
        D,
        E,
        n_group,
        topk_group,
        topk,
        int(renormalize),
        scale,
        w13.data_ptr(),
        s13.data_ptr(),
        *(t.data_ptr() if has_shared else None for t in shared[:2]),
        act.data_ptr(),
        I,
        int(pdl.ENABLED),
        stream,
    )
    if err:
        raise RuntimeError(f"moe_one_token: the router + gate/up launch failed with CUDA error {err}")
    err = lib.k26_moe_down_one_token(
        act.data_ptr(),
        w2.data_ptr(),
        s2.data_ptr(),
        out_ids.data_ptr(),
        out_w.data_ptr(),
        out.data_ptr(),
        D,
        I,
        E,
        topk,
        shared[2].data_ptr() if has_shared else None,
        int(pdl.ENABLED),
        stream,
    )
    if err:
        raise RuntimeError(f"moe_one_token: the down + combine launch failed with CUDA error {err}")
    return out
