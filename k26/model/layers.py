"""Building blocks shared by the target and the drafter: RMSNorm, SwiGLU MLP, vocab-parallel embedding
and head, and the tensor-parallel description passed in from above."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.k26.linear)
from ..ops.reference import rms_norm
from ..sampling import StepLogprobs, token_logprobs


@dataclass(frozen=True)
class TPInfo:
    """Which shard of the weights this process holds, and how to combine partial results.

    The collectives are passed in by the caller (k26.dist) so the model never owns a process group.
    `all_reduce` sums a tensor over the group; `all_gather` concatenates along the last dim.
    """

    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    # (partial, residual, norm weight, eps) -> (normed, new residual): the all-reduce fused with the residual
    # add and the next RMSNorm (k26.ops.allreduce_group.FusedAllReduce); None: the composition below.
    allreduce_add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is invalid for world size {self.size}")

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.all_reduce is None:
            raise RuntimeError(f"TP size {self.size} needs an all_reduce; none was provided")
        return self.all_reduce(x)

    def reduce_add_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h), h) with h = residual + all-reduce(partial): one fused collective when the group has
        it, else the all-reduce and then the add and the norm, as one op when `norm.use_kernel` (see
        `RMSNorm`), else as three steps (the reference)."""
        if self.size > 1 and self.allreduce_add_rmsnorm is not None:
            return self.allreduce_add_rmsnorm(partial, residual, norm.weight, norm.eps)
        if norm.use_kernel:  # the add and the norm as one op (csrc/add_rmsnorm.cu on CUDA)
            return torch.ops.k26.add_rmsnorm(self.reduce(partial), residual, norm.weight, norm.eps)
        h = residual + self.reduce(partial)
        return norm(h), h

    def check(self) -> None:
        """Raise a failure the fused collective recorded (a peer that never arrived, ranks called with
        different sizes). Inside a CUDA graph no front door runs, so the decoder asks after every step."""
        if (check := getattr(self.allreduce_add_rmsnorm, "check", None)) is not None:
            check()

    def close(self) -> None:
        """Release what the fused collective holds (peer mappings, its workspace, its watcher thread)."""
        if (close := getattr(self.allreduce_add_rmsnorm, "close", None)) is not None:
            close()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.all_gather is None:
            raise RuntimeError(f"TP size {self.size} needs an all_gather; none was provided")
        return self.all_gather(x)

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


# Rows up to which the drafter's projections and the dense MLP take the small-M kernel (more: cuBLAS), where
# no bit-equality between batch sizes is needed (MLA's decode / verify projections take it at every row count
# for that). Measured on an H200 (results/2026-12-07-drafter-kernel-swiglu-session45-h200.md): gate / up with
# SiLU·up 22.1 / 23.2 / 26.6 µs at 1 / 8 / 16 rows against cuBLAS + silu·mul 24.8 / 27.6 / 27.4, the down
# projection 11.0 / 11.4 / 13.1 against 10.8, and the step faster at the draft's 8 rows and the verify's 16;
# at 64 rows tile mode is 2-4x slower than cuBLAS (csrc/linear_smallm.cu: every 16-row block reads all of x).
KERNEL_MAX_ROWS = 16


def project(x: torch.Tensor, weight: torch.Tensor, use_kernel: bool) -> torch.Tensor:
    """x @ weight.T (no bias): `torch.ops.k26.linear`, the small-M streaming kernel, with `use_kernel`, else
    F.linear (cuBLAS). The one place a projection picks between them: a Linear, the head, and the matrices
    `stack_` builds (their rows are independent in the kernel's tile mode, so a stack's output equals its
    parts' outputs bit for bit there)."""
    return torch.ops.k26.linear(x, weight) if use_kernel else F.linear(x, weight)


class Linear(nn.Linear):
    """A bias-free projection. With `use_kernel` (see `use_linear_kernel`) it runs `torch.ops.k26.linear`,
    the small-M streaming kernel; that op runs F.linear itself for shapes the kernel does not serve
    (M > linear_cuda.MAX_ROWS, non-bf16), so the flag never changes results beyond rounding. (Every row count
    up to MAX_ROWS takes the kernel, prefills too: MLA routes its own projections, `AttnBatch.prefill`.)"""

    use_kernel: bool = False
    # Inputs of more rows than this take F.linear even with `use_kernel` (None: no bound). The drafter's
    # prefill context K/V runs at the prompt's length, where 64-row kernel launches lose to cuBLAS 2-4x.
    kernel_max_rows: int | None = None

    def kernel_for(self, x: torch.Tensor) -> bool:
        """Whether x's projection (or a stack's this module leads) runs the small-M kernel."""
        bound = self.kernel_max_rows
        return self.use_kernel and (bound is None or x.numel() // x.shape[-1] <= bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.kernel_for(x))


def linear(in_f: int, out_f: int, dtype: torch.dtype) -> Linear:
    return Linear(in_f, out_f, bias=False, dtype=dtype)


def stack_(*mods: nn.Linear) -> torch.Tensor:
    """The weights of projections that share an input, stacked into one matrix (one GEMM for all, after the
    weights are loaded); each keeps its parameter under its own name as a view of the stack (no extra
    memory)."""
    w = torch.cat([m.weight for m in mods])
    start = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[start : start + n], requires_grad=False)
        start += n
    return w


class RMSNorm(nn.Module):
    """HF precision: normalise in fp32, round to the activation dtype, then multiply by the weight.
    `use_kernel`: where it follows a residual add (`TPInfo.reduce_add_norm`), the add and the norm run as
    `torch.ops.k26.add_rmsnorm` (one kernel on CUDA, chained to its neighbours by programmatic dependent
    launch; same rounding points). `KimiK2.fuse_dense_` turns it on for inference: the op has no autograd
    formula, so a model trained through `forward_train` keeps it off."""

    use_kernel: bool = False

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU, column-parallel gate/up and row-parallel down; the caller reduces across ranks."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = linear(dim, inter, dtype)
        self.up_proj = linear(dim, inter, dtype)
        self.down_proj = linear(inter, dim, dtype)
        self.gate_up: torch.Tensor | None = None  # fuse_: [gate; up] stacked, one GEMM for both

    def fuse_(self) -> None:
        """Stack gate / up (same input: one launch for both, as gate_proj's `kernel_for` says at call time:
        cuBLAS, or the small-M kernel with SiLU·up in its epilogue, `torch.ops.k26.linear_swiglu`)."""
        if self.gate_up is None:
            self.gate_up = stack_(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.gate_proj.kernel_for(x):  # the stack and SiLU·up in one small-M launch
            return self.down_proj(torch.ops.k26.linear_swiglu(x, self.gate_up))
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class VocabEmbedding(nn.Module):
    """Rows [rank·V/tp, (rank+1)·V/tp) of the embedding; other ranks contribute zeros to the sum."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, tp: TPInfo):
        super().__init__()
        self.tp = tp
        self.part = tp.split(vocab, "vocab_size")
        self.start = tp.rank * self.part
        self.weight = nn.Parameter(torch.empty(self.part, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.part)
        x = F.embedding(local.clamp(0, self.part - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.reduce(x)


class VocabHead(nn.Module):
    """lm_head rows of this rank. `forward` gathers full fp32 logits; `argmax` and `topk_logprobs` merge
    shard-local results instead (a few values per rank), identically on every rank."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, tp: TPInfo):
        super().__init__()
        self.tp = tp
        self.part = tp.split(vocab, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.part, dim, dtype=dtype), requires_grad=False)

    use_kernel: bool = False  # as Linear's (see `use_linear_kernel`)

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's fp32 logits."""
        return project(x, self.weight, self.use_kernel).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.gather(self.local_logits(x))

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Global token ids of the largest logit; ties go to the smallest id, as torch.argmax does."""
        local = self.local_logits(x)
        if self.tp.size == 1:
            return local.argmax(-1)
        v, i = local.max(-1)
        vals = self.tp.gather(v[..., None])  # [..., tp], rank order = id order
        ids = self.tp.gather((i + self.tp.rank * self.part)[..., None])
        return ids.gather(-1, vals.argmax(-1, keepdim=True))[..., 0]

    def topk_logprobs(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most probable tokens under log_softmax over the whole vocabulary: (log-probs, global ids),
        sorted descending; each rank contributes its top-k and its log-sum-exp."""
        # One op for the shard's log-sum-exp and top-k (torch.ops.k26.logits_topk: two kernels on CUDA where
        # logsumexp + topk ran ~30); equal logits in column order, so a tie goes to the lower token id
        # whatever the TP size (the ranks' candidates are gathered in rank order, i.e. id order).
        v, i, lse = torch.ops.k26.logits_topk(self.local_logits(x), min(k, self.part))
        if self.tp.size > 1:
            v, i = self.tp.gather(v), self.tp.gather(i + self.tp.rank * self.part)
            lse = self.tp.gather(lse[..., None]).logsumexp(-1)
            v, j, _ = torch.ops.k26.logits_topk(v, min(k, v.shape[-1]))
            i = i.gather(-1, j)
        return v - lse[..., None], i

    def token_logprobs(self, x: torch.Tensor, ids: torch.Tensor, k: int) -> StepLogprobs:
        """`sampling.token_logprobs` of `ids` (top k) without gathering the vocabulary: each rank's
        log-sum-exp, top k and (on the rank that holds it) the chosen token's logit, merged as `topk_logprobs`
        does — a few values per rank instead of [..., vocab] fp32 on every rank."""
        local = self.local_logits(x)
        if self.tp.size == 1:
            return token_logprobs(local, ids, k)
        lse = self.tp.gather(local.logsumexp(-1, keepdim=True)).logsumexp(-1, keepdim=True)
        v, i = local.topk(min(k, self.part), dim=-1)
        v, i = self.tp.gather(v), self.tp.gather(i + self.tp.rank * self.part)
        v, j = v.topk(min(k, v.shape[-1]), dim=-1)
        at = ids - self.tp.rank * self.part
        mine = local.gather(-1, at.clamp(0, self.part - 1)[..., None])[..., 0]
        mine = torch.where((at >= 0) & (at < self.part), mine, float("-inf"))
        chosen = self.tp.gather(mine[..., None]).max(-1).values  # (one rank holds each id)
        return StepLogprobs(chosen - lse[..., 0], i.gather(-1, j), v - lse)


def use_linear_kernel(model: nn.Module, on: bool = True, max_rows: int | None = None) -> int:
    """Route every Linear, VocabHead and MLA W_UV of `model` through torch.ops.k26.linear / linear_grouped
    (or back to cuBLAS with on=False); returns how many modules switched. `max_rows`: the Linears' inputs of
    more rows stay on cuBLAS (`Linear.kernel_max_rows`). Opt-in for the whole model: measured on an H200
    (profiling/results/2026-12-01-bench_k26-glue-h200.md) it wins for the stacked q_a / kv_a and the MLA
    projections the loader switches (`KimiK2.fuse_dense_`), not for every layer; for the drafter, with its
    stacks, by ~0.02 ms a draft (2026-12-07-drafter-stacked-kernel-session44-h200.md)."""
    mods = [m for m in model.modules() if isinstance(m, (Linear, VocabHead))]
    for m in mods:
        m.use_kernel = on
        if isinstance(m, Linear):
            m.kernel_max_rows = max_rows
    return len(mods)
