"""Front door of the DDTree builder: `torch.ops.k26.ddtree_build`, its fake, input checks before any launch,
the per-shape plan (the kernel's scratch workspace, allocated once) and the CUDA kernel
(csrc/ddtree_build.cu, one thread block per tree); the pure-torch reference `reference_tree.ddtree_build` (the
specification) on every other device and for shapes the kernel does not hold.

    ddtree_build(lp [B, L, K] float, tok [B, L, K] int, budget) -> (tokens, parents, depths, valid, words,
        scores): [B, 1 + budget] int64 x3, bool, int64 words [B, 1 + budget, ceil((1 + budget) / 64)],
        float64; nodes in pop order, root first, padded with invalid nodes (see reference_tree.ddtree_build)

`lp` / `tok` are the drafter's per-depth top-K, sorted descending (what `Tensor.topk` returns): the
builder relies on that order and does not check it (a check would read the data back to the host).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import reference_tree

# csrc/ddtree_build.cu: MAX_BUDGET (its shared-memory candidate arrays), and the per-depth beam widths it
# keeps in a 16-entry array (L <= 15: a block of 16, the largest DFlash drafters ship)
MAX_BUDGET, MAX_DEPTH = 512, 15


def _outputs(lp: torch.Tensor, budget: int, new) -> tuple[torch.Tensor, ...]:
    B, N = lp.shape[0], 1 + budget
    i64 = {"dtype": torch.int64, "device": lp.device}
    return (
        new((B, N), **i64),
        new((B, N), **i64),
        new((B, N), **i64),
        new((B, N), dtype=torch.bool, device=lp.device),
        new((B, N, (N + 63) // 64), **i64),
        new((B, N), dtype=torch.float64, device=lp.device),
    )


@torch.library.custom_op("k26::ddtree_build", mutates_args=())
def ddtree_build(
    lp: torch.Tensor, tok: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(lp, tok, budget)
    return reference_tree.ddtree_build(lp, tok, budget)


@ddtree_build.register_fake
def _(lp, tok, budget):
    check_inputs(lp, tok, budget)
    return _outputs(lp, budget, lambda shape, **kw: lp.new_empty(shape, **kw))


def check_inputs(lp: torch.Tensor, tok: torch.Tensor, budget: int) -> None:
    """Every shape / dtype / device problem as a ValueError naming the argument (host metadata only:
    nothing here runs on the device, so it costs nothing inside a captured step)."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"ddtree_build: {msg}")

    need(budget >= 1, f"budget={budget!r} must be >= 1")  # (the schema already refuses a non-integer)
    need(
        lp.dim() == 3 and lp.is_floating_point(),
        f"lp must be floating [B, L, K] (per-depth top-K log-probs), got {lp.dtype} {list(lp.shape)}",
    )
    need(
        lp.shape[1] >= 1 and lp.shape[2] >= 1, f"lp needs at least one depth and one token: {list(lp.shape)}"
    )
    need(
        tok.shape == lp.shape and not tok.is_floating_point() and tok.dtype != torch.bool,
        f"tok must be integer {list(lp.shape)} like lp, got {tok.dtype} {list(tok.shape)}",
    )
    need(tok.device == lp.device, f"tok is on {tok.device}, lp on {lp.device}")


class _Plans:
    """Per (device, B, L, budget) the kernel's scratch (each tree's beams: fp64 scores and four int indices
    per depth and slot, L2-resident; the kernel keeps small trees' beams in shared memory), allocated once
    and reused by every call of that shape — the steps of all of a batch's buckets share it, one launch at a
    time on one stream, like the attention workspace. The kernel's shared-memory opt-in is made once per
    device."""

    def __init__(self) -> None:
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._prepared: set[torch.device] = set()

    def scratch(self, lib, device: torch.device, B: int, L: int, budget: int) -> torch.Tensor:
        key = (device, B, L, budget)
        ws = self._scratch.get(key)
        if ws is None:
            if device not in self._prepared:
                with torch.cuda.device(device):
                    err = lib.k26_ddtree_prepare()
                if err:
                    raise RuntimeError(f"ddtree_build: kernel set-up failed with CUDA error {err}")
                self._prepared.add(device)
            ws = torch.empty(lib.k26_ddtree_scratch(B, L, budget), dtype=torch.uint8, device=device)
            if torch.cuda.is_current_stream_capturing():
                return ws  # owned by the graph's pool: never cached
            self._scratch[key] = ws
        return ws


PLANS = _Plans()


@functools.cache  # once per process, like build.library
def _library() -> ctypes.CDLL:
    """The kernel library with this op's ctypes signatures (csrc/ddtree_build.cu)."""
    from .build import library  # lazily: `python -m k26.ops.build` must not import itself first

    lib = library()
    lib.k26_ddtree_prepare.restype = ctypes.c_int
    lib.k26_ddtree_prepare.argtypes = []
    lib.k26_ddtree_scratch.restype = ctypes.c_size_t
    lib.k26_ddtree_scratch.argtypes = [ctypes.c_int] * 3
    lib.k26_ddtree_build.restype = ctypes.c_int
    # lp, tok; B, L, K, budget; tokens, parents, depths, valid, words, scores, scratch, stream
    lib.k26_ddtree_build.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 8
    return lib


@ddtree_build.register_kernel("cuda")
def _(lp, tok, budget):
    from .build import available

    check_inputs(lp, tok, budget)
    B, L, K = lp.shape
    if budget > MAX_BUDGET or L > MAX_DEPTH or B == 0 or not available():
        return reference_tree.ddtree_build(lp, tok, budget)  # graph-safe too: no host reads, no host tables
    lib = _library()
    out = _outputs(lp, budget, torch.empty)
    scratch = PLANS.scratch(lib, lp.device, B, L, budget)
    lp32, tok64 = lp.float().contiguous(), tok.to(torch.int64).contiguous()
    err = lib.k26_ddtree_build(
        lp32.data_ptr(),
        tok64.data_ptr(),
        B,
        L,
        K,
        budget,
        *(t.data_ptr() for t in out),
        scratch.data_ptr(),
        torch.cuda.current_stream(lp.device).cuda_stream,
    )
    if err:
        raise RuntimeError(f"ddtree_build: CUDA launch failed with error {err}")
    return out
