"""`FusedAllReduce`: the per-TP-group owner of the fused all-reduce + add + RMSNorm (the op and its kernel:
k26/ops/allreduce_cuda.py). Built once per TP group on every rank (a collective): each rank allocates its
workspace, the CUDA IPC handles travel once through the group (all_gather_object) and every rank maps every
peer's. When a peer cannot be mapped (no peer-to-peer access, another host) every rank falls back to the
composition over NCCL and says why once. Per call: one-shot below `two_shot_bytes`, two-shot (reduce-scatter
+ all-gather of rows) from there up to `max_bytes`, the NCCL composition above. The kernel owns its epoch
counter (graph replays count on by themselves); a peer that never answers within `timeout_s`, or that was
called with another size, is reported by `check()` (run before every eager call, and by the decoder after
every step) as a RuntimeError naming the rank.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading

import torch
import torch.distributed as dist

from .allreduce_cuda import BLOCK_DIM_ALIGN, check_add_rmsnorm, composition, cuda_error, library, limits
from .log import say_once

_log = logging.getLogger(__name__)
# (two-shot from, NCCL above) in message bytes per TP size. 2: measured in-graph on two H200s (NVLink,
# 2026-12-01, profiling/results/2026-12-01-bench_tp2-fused-h200x2.md): one-shot ahead of two-shot at every
# size through 3.5 MiB (24.1 vs 27.0 µs) and of NCCL alone, so no two-shot below the NCCL cut; 4 and 8: the
# crossovers published for PCIe RTX PRO 6000 (profiling/results/2026-12-01-allreduce_pcie8-model.md).
# `calibrate()` (LLM(allreduce="calibrate")) measures them at start-up instead.
CROSSOVERS = {2: (4 << 20, 4 << 20), 4: (84 << 10, 768 << 10), 8: (112 << 10, 768 << 10)}


def check_inputs(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    op = "k26.allreduce_add_rmsnorm"
    check_add_rmsnorm(x, residual, weight, op)
    for name, t in (("residual", residual), ("weight", weight)):  # (the kernel reads all three alike)
        if t.dtype != x.dtype:
            raise ValueError(f"{op}: {name} is {t.dtype}, x {x.dtype}")


def crossovers(sizes: list[int], times: list, nccl_bytes: int) -> tuple[int, int]:
    """(two_shot_bytes, nccl_bytes) from µs [one-shot, two-shot, NCCL] per ascending message size: each from
    the smallest size where it wins there and at every larger one (NCCL runs *above* nccl_bytes: one less)."""
    wins2 = [t[1] <= t[0] for t in times]
    wins_nccl = [t[2] < min(t[:2]) for t in times]
    two = next((sizes[i] for i in range(len(sizes)) if all(wins2[i:])), 1 << 62)
    return two, next((sizes[i] - 1 for i in range(len(sizes)) if all(wins_nccl[i:])), nccl_bytes)


class FusedAllReduce:
    """The peer-mapped workspaces, epoch counter and error word of one TP group on this rank. Collective:
    every rank of `group` builds it at the same point. Call it as `(x, residual, weight, eps) -> (normed,
    new residual)`. `p2p` says whether the kernel serves this group (else `why`, and the composition runs)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        *,
        max_bytes: int | None = None,
        two_shot_bytes: int | None = None,
        timeout_s: float = 300.0,
    ):
        self.group = group or dist.group.WORLD
        self.group_name = self.group.group_name
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        default_two_shot, default_max = CROSSOVERS.get(self.world, CROSSOVERS[8])
        max_bytes = default_max if max_bytes is None else max_bytes
        self.two_shot_bytes = default_two_shot if two_shot_bytes is None else two_shot_bytes
        self.timeout_ns = int(timeout_s * 1e9)
        self.cap = max_bytes // 2 // BLOCK_DIM_ALIGN * BLOCK_DIM_ALIGN  # elements per data region
        self.nccl_bytes = max_bytes  # larger messages run the composition (`calibrate` may lower it)
        self._own: ctypes.c_void_p | None = None
        self._mapped: list[int] = []
        self.peers = torch.empty(0, dtype=torch.int64)
        self.why = self._map_peers()
        self.p2p = self.why is None
        self._stop = threading.Event()
        if self.p2p:
            self.ctl = torch.zeros(4, dtype=torch.int32, device=self.device)  # epoch, done, err, info
            self.err = torch.zeros(2, dtype=torch.int32).pin_memory()  # read by the host without a sync
            threading.Thread(target=self._watch, args=(self._stop,), daemon=True, name="k26-ar-watch").start()
        else:
            self.ctl = torch.zeros(0, dtype=torch.int32)
            self.err = torch.zeros(2, dtype=torch.int32)
            say_once(
                __name__,
                logging.WARNING,
                f"k26: fused all-reduce unavailable ({self.why}); all-reduce, add and RMSNorm run instead",
            )
        self.max_dim = limits()[1] if self.p2p else 0

    def _map_peers(self) -> str | None:
        """Allocate and share our workspace, map every peer's; None when all ranks mapped all peers, else
        why not (the same answer on every rank)."""
        why = None
        handle = ctypes.create_string_buffer(64)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            why = f"rank {self.rank} has no CUDA device"
        else:
            try:
                lib = library()
                max_ranks, _ = limits()
                if self.world > max_ranks:
                    why = f"{self.world} ranks, the kernel serves up to {max_ranks}"
                else:
                    own = ctypes.c_void_p()
                    e = lib.k26_ar_alloc(
                        self.device.index, lib.k26_ar_workspace_bytes(self.world, self.cap), own, handle
                    )
                    if e:
                        why = f"rank {self.rank}: workspace allocation failed: {cuda_error(e)}"
                    else:
                        self._own = own
            except (OSError, RuntimeError) as ex:  # no kernel library (BuildError is a RuntimeError)
                why = f"rank {self.rank}: no kernel library ({ex})"
        infos: list = [None] * self.world
        dist.all_gather_object(infos, (handle.raw, socket.gethostname(), why), group=self.group)
        why = next((w for *_, w in infos if w), None)
        ptrs = [0] * self.world
        if why is None:
            for q, (h, host, _) in enumerate(infos):
                if q == self.rank:
                    ptrs[q] = self._own.value
                elif host != infos[self.rank][1]:
                    why = f"rank {q} is on host {host}, rank {self.rank} on {infos[self.rank][1]}"
                else:
                    p = ctypes.c_void_p()
                    e = library().k26_ar_open(self.device.index, ctypes.create_string_buffer(h, 64), p)
                    if e:
                        why = f"rank {self.rank} cannot map rank {q}'s memory: {cuda_error(e)}"
                        break
                    self._mapped.append(p.value)
                    ptrs[q] = p.value
        answers: list = [None] * self.world
        dist.all_gather_object(answers, why, group=self.group)
        why = next((w for w in answers if w), None)
        if why is None:
            self.peers = torch.tensor(ptrs, dtype=torch.int64)
        else:
            self.close()
        return why

    def close(self) -> None:
        """Unmap the peers and free our workspace (every rank, after its last call)."""
        if hasattr(self, "_stop"):
            self._stop.set()
        if self._mapped or self._own is not None:
            torch.cuda.synchronize(self.device)
        for p in self._mapped:
            library().k26_ar_close(p)
        self._mapped = []
        if self._own is not None:
            library().k26_ar_free(self._own)
            self._own = None
        self.peers = torch.empty(0, dtype=torch.int64)

    def error(self) -> str | None:
        """The failure an earlier launch recorded (a peer that timed out, or a size mismatch), or None."""
        code, info = (int(v) for v in self.err.tolist())
        if not code:
            return None
        kind, peer = code >> 8, (code & 0xFF) - 1
        if kind == 2:
            return (
                f"k26 fused all-reduce: rank {peer} was called with {info} elements, a different size than "
                f"rank {self.rank} (the ranks ran different batches)"
            )
        return (
            f"k26 fused all-reduce: rank {self.rank} waited {self.timeout_ns / 1e9:g} s for rank {peer}, "
            "which never arrived (it died, or is stuck elsewhere)"
        )

    def check(self) -> None:
        """Raise the recorded failure as a RuntimeError naming the rank (run before every eager call)."""
        if (msg := self.error()) is not None:
            raise RuntimeError(msg)

    def _watch(self, stop: threading.Event) -> None:
        """Inside CUDA graphs no front door runs: say a recorded failure in the log within ~0.2 s (the
        error word is host memory: no CUDA call, no sync)."""
        while not stop.wait(0.2):
            if (msg := self.error()) is not None:
                _log.error(msg)
                return

    def calibrate(self, D: int = 7168, rows=(1, 2, 4, 8, 16, 32, 64, 128, 256), reps: int = 10) -> list:
        """Measure the crossovers (collective; at start-up): in-graph µs per call of one-shot, two-shot
        and, on NCCL, the composition for D x N bf16; `two_shot_bytes` and `nccl_bytes` become the sizes
        from which each wins at every larger N. The slowest rank's times decide, so every rank agrees.
        Returns [(N, one-shot µs, two-shot µs, NCCL µs)]."""
        w = torch.ones(D, dtype=torch.bfloat16, device=self.device)
        nccl = dist.get_backend(self.group) == "nccl"
        times = torch.full((len(rows), 3), float("inf"), dtype=torch.float64)
        keep = self.two_shot_bytes
        for i, n in enumerate(rows):
            x, r = torch.randn(2, n, D, device=self.device).bfloat16()
            for j, two in enumerate((1 << 62, 0, None)):
                if (two is None and not nccl) or (two is not None and (n * D > self.cap or not self.p2p)):
                    continue
                self.two_shot_bytes = two if two is not None else keep
                if two == 0 and n < self.world:
                    continue  # row-sliced: the two-shot needs a row per rank

                def body(x=x, r=r, via_nccl=two is None):
                    return composition(x, r, w, 1e-6, self.group) if via_nccl else self(x, r, w, 1e-6)

                body()  # warm-up outside capture
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(reps):
                        body()
                g.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(3):
                    g.replay()
                end.record()
                end.synchronize()
                times[i, j] = start.elapsed_time(end) * 1e3 / (3 * reps)
        self.two_shot_bytes = keep
        t = times.to(self.device) if nccl else times
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        times = t.cpu()
        sizes = [2 * n * D for n in rows]
        self.two_shot_bytes, self.nccl_bytes = crossovers(sizes, times.tolist(), self.nccl_bytes)
        return [(n, *times[i].tolist()) for i, n in enumerate(rows)]

    def unsupported(self, x: torch.Tensor) -> str | None:
        """Why the kernel does not serve `x` (the composition then runs), or None."""
        if not self.p2p:
            return self.why
        if x.dtype != torch.bfloat16:
            return f"dtype {x.dtype} (the kernel is bf16)"
        D = x.shape[-1]
        if D % BLOCK_DIM_ALIGN or D > self.max_dim:
            return f"width {D} (the kernel needs a multiple of 8 up to {self.max_dim})"
        return None if x.numel() else "an empty tensor"

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tracing = torch.compiler.is_compiling()  # torch.compile(fullgraph=True): nothing host-side here
        if not tracing and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            check_inputs(x, residual, weight)
            self.check()
        why = self.unsupported(x)
        x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
        if why is not None or x.numel() > self.cap or 2 * x.numel() > self.nccl_bytes:  # above: NCCL
            if why is not None and not tracing:
                say_once(
                    __name__,
                    logging.WARNING,
                    f"k26 fused all-reduce: {why}: all-reduce, add and RMSNorm run instead",
                )
            return composition(x, residual, weight, eps, self.group)
        return torch.ops.k26.allreduce_add_rmsnorm(
            x,
            residual,
            weight,
            float(eps),
            self.group_name,
            self.peers,
            self.ctl,
            self.err,
            self.rank,
            self.cap,
            self.two_shot_bytes,
            self.timeout_ns,
        )
