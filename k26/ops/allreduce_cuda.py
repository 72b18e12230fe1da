"""Tensor-parallel all-reduce fused with the residual add and the next RMSNorm (csrc/allreduce_fused.cu):
`torch.ops.k26.allreduce_add_rmsnorm`, its reference (today's composition: all-reduce, add, RMSNorm), fake
and CUDA kernel. The per-TP-group owner of the peer-mapped workspaces that drive it, and the one callers
use, is `FusedAllReduce` (k26/ops/allreduce_group.py).

    allreduce_add_rmsnorm(x [..., D], residual [..., D], weight [D], eps, group, ...) -> (normed, new resid.)
        new residual = residual + all_reduce(x);  normed = RMSNorm(new residual) * weight

and what follows an all-reduce on one GPU (no peers: TP 1, after NCCL), `torch.ops.k26.add_rmsnorm`:

    add_rmsnorm(x [..., D], residual [..., D], weight [D], eps) -> (RMSNorm(residual + x), residual + x)

one kernel (csrc/add_rmsnorm.cu) with the same row arithmetic as the fused all-reduce (csrc/rmsnorm_row.cuh).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.distributed as dist

from . import pdl
from .packed import packed
from .reference import rms_norm

BLOCK_DIM_ALIGN = 8  # the kernel moves 16-byte vectors: D and the region size are multiples of 8 bf16


# ---------------------------------------------------------------- reference and op registration


def add_rmsnorm_reference(
    reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What follows the all-reduce: (RMSNorm(residual + reduced), residual + reduced)."""
    h = residual + reduced
    return rms_norm(h, weight, eps), h


@torch.library.custom_op("k26::add_rmsnorm", mutates_args=())
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x) * weight, residual + x), the reference's rounding points."""
    check_add_rmsnorm(x, residual, weight)
    return add_rmsnorm_reference(x, residual, weight, eps)


def check_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, op: str = "k26.add_rmsnorm"
) -> None:
    """residual of x's shape, weight [D] (x's last dim), one device: a ValueError naming the argument (torch
    broadcast a residual of one row over every row, and a wrong weight was a RuntimeError from inside it)."""
    if x.dim() < 1 or residual.shape != x.shape:
        raise ValueError(f"{op}: residual {list(residual.shape)} must have x's shape {list(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"{op}: weight must be [{x.shape[-1]}] (x's last dim), got {list(weight.shape)}")
    if not x.device == residual.device == weight.device:
        raise ValueError(f"{op}: residual and weight must be on x's device {x.device}")


def add_rmsnorm_meta(x, residual, weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty outputs of the reference's shapes and dtypes (broadcast, promoted), contiguous like the
    kernels': add_rmsnorm's fake, and allreduce_add_rmsnorm's (the all-reduce keeps x's shape and dtype)."""
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    h_dtype = torch.promote_types(residual.dtype, x.dtype)
    out_dtype = torch.promote_types(weight.dtype, h_dtype)
    return residual.new_empty(shape, dtype=out_dtype), residual.new_empty(shape, dtype=h_dtype)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    check_add_rmsnorm(x, residual, weight)
    return add_rmsnorm_meta(x, residual, weight)


@torch.library.custom_op("k26::allreduce_add_rmsnorm", mutates_args=())
def allreduce_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
    peers: torch.Tensor,
    ctl: torch.Tensor,
    err: torch.Tensor,
    rank: int,
    cap: int,
    two_shot_bytes: int,
    timeout_ns: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: all-reduce over `group_name`, then the add and the RMSNorm. `peers` (int64 CPU,
    every rank's workspace address as mapped here; empty: this composition on every device), `ctl`,
    `err`, `rank`, `cap`, `two_shot_bytes` and `timeout_ns` drive the CUDA kernel (FusedAllReduce)."""
    return composition(x, residual, weight, eps, _group(group_name))


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def composition(x, residual, weight, eps: float, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's three steps: NCCL (or gloo) all-reduce over `group`, residual add, RMSNorm."""
    s = x.contiguous().clone()
    dist.all_reduce(s, group=group)
    return add_rmsnorm_reference(s, residual, weight, eps)


@allreduce_add_rmsnorm.register_fake
def _(x, residual, weight, eps, group_name, peers, ctl, err, rank, cap, two_shot_bytes, timeout_ns):
    return add_rmsnorm_meta(x, residual, weight)  # (was residual's shape and dtype, whatever x's)


# ---------------------------------------------------------------- CUDA kernel


@functools.cache  # once per process, like build.library
def library() -> ctypes.CDLL:
    """The kernel library with the all-reduce's ctypes signatures (csrc/allreduce_fused.cu)."""
    from . import build  # lazily: `python -m k26.ops.build` must not import itself first

    lib = build.library()
    P, I, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.k26_ar_workspace_bytes.restype = ctypes.c_size_t
    lib.k26_ar_workspace_bytes.argtypes = [I, LL]
    lib.k26_ar_limits.argtypes = [ctypes.POINTER(I)] * 2
    lib.k26_ar_alloc.argtypes = [I, ctypes.c_size_t, ctypes.POINTER(P), P]
    lib.k26_ar_open.argtypes = [I, P, ctypes.POINTER(P)]
    lib.k26_ar_close.argtypes = [P]
    lib.k26_ar_free.argtypes = [P]
    lib.k26_ar_error_string.restype = ctypes.c_char_p
    lib.k26_ar_error_string.argtypes = [I]
    lib.k26_ar_launch.argtypes = [P] * 5 + [ctypes.POINTER(P), P, P, LL, LL, ctypes.c_float] + [I] * 6 + [P]
    lib.k26_add_rmsnorm.argtypes = [P] * 5 + [I, I, ctypes.c_float, I, P]
    lib.k26_add_rmsnorm_max_dim.restype = I
    return lib


def cuda_error(e: int) -> str:
    return library().k26_ar_error_string(e).decode()


@functools.cache  # compile-time constants of the library: read once, not on every op call
def limits() -> tuple[int, int]:
    """(most ranks, largest D) the kernel serves."""
    r, d = ctypes.c_int(), ctypes.c_int()
    library().k26_ar_limits(ctypes.byref(r), ctypes.byref(d))
    return r.value, d.value


def vector_ready(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as the kernels read them: contiguous, at 16-byte aligned addresses (copied if not)."""
    return tuple(map(packed, ts))


@torch.library.register_kernel("k26::allreduce_add_rmsnorm", "cuda")
def _(x, residual, weight, eps, group_name, peers, ctl, err, rank, cap, two_shot_bytes, timeout_ns):
    if peers.numel() == 0:
        return composition(x, residual, weight, eps, _group(group_name))
    # The kernel takes rows and D from x and reads residual and weight as alike: anything else it would read
    # out of bounds (or as another type), so it is named here
    D = x.shape[-1]
    if residual.shape != x.shape or weight.shape != (D,) or not x.dtype == residual.dtype == weight.dtype:
        raise ValueError(
            f"allreduce_add_rmsnorm: residual must match x {list(x.shape)} {x.dtype} and weight be [{D}] of "
            f"that dtype, got residual {list(residual.shape)} {residual.dtype}, weight {list(weight.shape)} "
            f"{weight.dtype}"
        )
    # Nor does it check the type, the width or its peers' capacity: a float32 x was read and written as bf16,
    # and rows past `cap` elements were pushed past the peers' workspaces.
    max_ranks, max_dim = limits()
    if x.dtype != torch.bfloat16 or D % BLOCK_DIM_ALIGN or D > max_dim or x.numel() > cap:
        raise ValueError(
            f"allreduce_add_rmsnorm: the kernel takes bf16 x of width a multiple of {BLOCK_DIM_ALIGN} up to "
            f"{max_dim} and at most cap={cap} elements, got {x.dtype} {list(x.shape)}"
        )
    if not 1 <= peers.numel() <= max_ranks or not 0 <= rank < peers.numel():
        raise ValueError(
            f"allreduce_add_rmsnorm: rank {rank} of {peers.numel()} peers (the kernel: <= {max_ranks})"
        )
    # The kernel moves 16-byte vectors. An unaligned view is copied, never sent down another path: whether
    # a tensor is aligned is this rank's own business, and ranks on different paths would wait on each other.
    given = weight  # read before the kernel's wait (pdl.enabled_as_given)
    x, residual, weight = vector_ready(x, residual, weight)
    world, D = peers.numel(), x.shape[-1]
    rows = x.numel() // D
    out, res_out = torch.empty_like(residual), torch.empty_like(residual)
    ws = (ctypes.c_void_p * world)(*peers.tolist())
    two_shot = int(rows >= world and 2 * x.numel() >= two_shot_bytes)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    e = library().k26_ar_launch(
        *(t.data_ptr() for t in (x, residual, weight, out, res_out)),
        ws,
        ctl.data_ptr(),
        err.data_ptr(),
        timeout_ns,
        cap,
        eps,
        rows,
        D,
        rank,
        world,
        two_shot,
        # PDL overlaps the kernel before / the peers' wait (not yet measured on two GPUs)
        int(pdl.enabled_as_given((weight, given))),
        stream,
    )
    if e:
        raise RuntimeError(f"k26.allreduce_add_rmsnorm: launch failed: {cuda_error(e)}")
    return out, res_out


def add_rmsnorm_served(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether csrc/add_rmsnorm.cu takes this call (the reference does otherwise): bf16 on one CUDA device,
    matching shapes, a D of whole 16-byte vectors within the kernel's registers."""
    D = x.shape[-1]
    return (
        x.dtype == residual.dtype == weight.dtype == torch.bfloat16
        and x.shape == residual.shape
        and weight.shape == (D,)
        and x.device == residual.device == weight.device
        and x.numel() > 0
        and D % BLOCK_DIM_ALIGN == 0
        and D <= library().k26_add_rmsnorm_max_dim()
    )


@torch.library.register_kernel("k26::add_rmsnorm", "cuda")
def _(x, residual, weight, eps):
    check_add_rmsnorm(x, residual, weight)
    if not add_rmsnorm_served(x, residual, weight):
        return add_rmsnorm_reference(x, residual, weight, eps)
    given = weight  # read before the kernel's wait (pdl.enabled_as_given)
    x, residual, weight = vector_ready(x, residual, weight)
    out, res_out = torch.empty_like(residual), torch.empty_like(residual)
    D = x.shape[-1]
    e = library().k26_add_rmsnorm(
        *(t.data_ptr() for t in (x, residual, weight, out, res_out)),
        x.numel() // D,
        D,
        eps,
        int(pdl.enabled_as_given((weight, given))),
        torch.cuda.current_stream(x.device).cuda_stream,
    )
    if e:
        raise RuntimeError(f"k26.add_rmsnorm: launch failed: {cuda_error(e)}")
    return out, res_out
