"""The fused all-reduce + residual add + RMSNorm kernel (k26/ops/csrc/allreduce_fused.cu) against its
NCCL-free reference, with real ranks: one process per rank, the workspaces shared through CUDA IPC.

With one GPU the ranks all run on cuda:0 (CUDA IPC works between processes of one device, and their
kernels time-slice): that checks the protocol (peer writes, flags, epochs, double buffers, graph replays,
timeouts), NOT speed. With two or more GPUs rank r runs on cuda:r (the `multigpu` tests). Commands:

    python -m pytest -q tests/test_allreduce_gpu.py -m gpu              # one GPU: 2 and 4 ranks on cuda:0
    python -m pytest -q tests/test_allreduce_gpu.py -m multigpu         # two GPUs: 10,000 graph replays
    python tests/test_allreduce_gpu.py 0 2 29533 OUTDIR 10000 devices   # one rank by hand (both ranks)

The reference, per rank: every rank regenerates every rank's partial from seeds, sums them in fp32 in rank
order, rounds to bf16, adds the residual and normalises (k26.ops.allreduce_cuda.add_rmsnorm_reference).
The new residual must equal it bitwise; the normed output within one bf16 rounding (rsqrt and the row sum's
order differ from torch's); and every rank's outputs must be bit-identical (digests compared at the end).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from oracles import bf16_ulps

D, EPS = 7168, 1e-6


def _inputs(step: int, rows: int, world: int, dev) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's partial and the (replicated) residual of one step: fresh random values, never zeros."""
    g = torch.Generator(device=dev).manual_seed(1000 + step)
    parts = [torch.randn(rows, D, device=dev, generator=g).bfloat16() for _ in range(world)]
    return parts, torch.randn(rows, D, device=dev, generator=g).bfloat16()


def _reference(parts, residual, weight):
    from k26.ops.allreduce_cuda import add_rmsnorm_reference

    acc = parts[0].float()
    for p in parts[1:]:  # rank order, fp32: the kernel's order
        acc = acc + p.float()
    return add_rmsnorm_reference(acc.bfloat16(), residual, weight, EPS)


def _check(out, res, parts, residual, weight, what: str) -> None:
    """h bitwise; the normed output within bf16 rounding: rstd (rsqrtf, the row sum's order) may move
    bf16(h * rstd) by one ulp, and the product with the weight rounds again: at most 2 ulps."""
    ref_out, ref_res = _reference(parts, residual, weight)
    assert torch.equal(res, ref_res), f"{what}: new residual differs from the reference"
    worst = bf16_ulps(out, ref_out).max().item()
    assert worst <= 2, f"{what}: normed output {worst:.1f} bf16 ulps from the reference"


def _assert_the_op_refuses_what_its_kernel_cannot_take(ar, rank: int, weight: torch.Tensor) -> None:
    """The op's CUDA door (no launch: every rank refuses alike, no peer waits): a float32 x was read and
    written as bf16, and more than `cap` elements were pushed past the peers' workspaces."""
    args = (ar.group_name, ar.peers, ar.ctl, ar.err, rank, ar.cap, ar.two_shot_bytes, ar.timeout_ns)
    big = torch.randn(ar.cap // D + 1, D, device=weight.device).bfloat16()
    for x, w in ((big[:2].float(), weight.float()), (big, weight)):
        try:
            torch.ops.k26.allreduce_add_rmsnorm(x, torch.zeros_like(x), w, EPS, *args)
        except ValueError as e:
            assert "allreduce_add_rmsnorm: the kernel takes bf16" in str(e), e
        else:
            raise AssertionError(f"{x.dtype} {list(x.shape)} (cap {ar.cap}) was launched")


def worker(rank: int, world: int, port: int, out_dir: str, replays: int, devices: bool) -> None:
    import torch.distributed as dist

    from k26.ops.allreduce_group import FusedAllReduce

    dev = torch.device("cuda", rank if devices else 0)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    weight = torch.randn(D, device=dev, generator=torch.Generator(device=dev).manual_seed(7)).bfloat16()
    digest = hashlib.sha256()
    log = []

    # Eager: one-shot and two-shot (forced by the crossover), row counts around the slice boundaries.
    for two_shot_bytes in (1 << 40, 0):
        ar = FusedAllReduce(device=dev, timeout_s=60, two_shot_bytes=two_shot_bytes, max_bytes=4 << 20)
        assert ar.p2p, ar.why
        if two_shot_bytes:
            _assert_the_op_refuses_what_its_kernel_cannot_take(ar, rank, weight)
        for step, rows in enumerate((1, 3, world, 2 * world + 1, 17, 64)):
            parts, residual = _inputs(step, rows, world, dev)
            out = ar(parts[rank], residual, weight, EPS)
            torch.cuda.synchronize()
            _check(*out, parts, residual, weight, f"eager rows={rows} two_shot_bytes={two_shot_bytes}")
            digest.update(out[0].cpu().view(torch.int16).numpy().tobytes())
        ar.check()
        ar.close()

    # CUDA graph: two fused calls chained (the second's residual is the first's output), replayed with new
    # inputs copied into the static buffers before each replay; every replay checked.
    ar = FusedAllReduce(device=dev, timeout_s=60)
    rows = 4
    x1, x2, r0 = (torch.empty(rows, D, dtype=torch.bfloat16, device=dev) for _ in range(3))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside capture (the allocator, the op's first call)
            n1, h1 = ar(x1, r0, weight, EPS)
            n2, h2 = ar(x2, h1, weight, EPS)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        n1, h1 = ar(x1, r0, weight, EPS)
        n2, h2 = ar(x2, h1, weight, EPS)
    t0 = time.perf_counter()
    for step in range(replays):
        parts, residual = _inputs(10_000 + step, 2 * rows, world, dev)
        x1.copy_(parts[rank][:rows])
        x2.copy_(parts[rank][rows:])
        r0.copy_(residual[:rows])
        for t in (n1, h1, n2, h2):  # poison: a replay that writes nothing fails
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        p1, p2 = [p[:rows] for p in parts], [p[rows:] for p in parts]
        _check(n1, h1, p1, residual[:rows], weight, f"replay {step} first call")
        _check(n2, h2, p2, h1, weight, f"replay {step} second call")
        if step < 64 or step % 97 == 0:
            digest.update(n2.cpu().view(torch.int16).numpy().tobytes())
    dt = time.perf_counter() - t0
    ar.check()
    log.append(f"rank {rank}: {replays} replays of 2 fused calls (rows={rows}) checked in {dt:.2f} s")

    # A rank that never arrives: rank 0 waits `timeout_s` and reports rank 1 by name (the others sit out).
    bad = FusedAllReduce(device=dev, timeout_s=2)
    parts, residual = _inputs(0, 2, world, dev)
    if rank == 0:
        bad(parts[0], residual, weight, EPS)
        torch.cuda.synchronize()
        try:
            bad.check()
            log.append("rank 0: NO ERROR for a missing peer")
        except RuntimeError as e:
            log.append(f"rank 0 missing-peer error: {e}")
    dist.barrier()
    # Different sizes on different ranks: a clear error on the ranks, naming the peer.
    bad = FusedAllReduce(device=dev, timeout_s=10)
    parts, residual = _inputs(0, 2 + rank, world, dev)
    bad(parts[rank], residual, weight, EPS)
    torch.cuda.synchronize()
    try:
        bad.check()
        log.append(f"rank {rank}: NO ERROR for mismatched sizes")
    except RuntimeError as e:
        log.append(f"rank {rank} mismatch error: {e}")
    # Start-up measurement of the crossovers: every rank must take the same decisions (times here are
    # time-sliced ranks, meaningless as speed; the decisions' agreement is what is checked).
    cal = FusedAllReduce(device=dev, timeout_s=60, max_bytes=1 << 20)
    table = cal.calibrate(rows=(1, 4, 16), reps=2)
    digest.update(f"{cal.two_shot_bytes} {cal.nccl_bytes}".encode())
    log.append(f"rank {rank}: calibrate {table} -> two-shot from {cal.two_shot_bytes} B")
    cal.check()

    Path(out_dir, f"rank{rank}.txt").write_text(digest.hexdigest() + "\n" + "\n".join(log) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, replays: int, devices: bool, tmp_path: Path, timeout: float = 540) -> list[str]:
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                str(r),
                str(world),
                str(port),
                str(tmp_path),
                str(replays),
                str(int(devices)),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for r, (p, o) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{o[-4000:]}"
    return [Path(tmp_path, f"rank{r}.txt").read_text() for r in range(world)]


def _assert_ranks(texts: list[str], world: int) -> None:
    digests = {t.splitlines()[0] for t in texts}
    assert len(digests) == 1, f"ranks' outputs are not bit-identical: {digests}"
    print("".join(texts))
    assert re.search(r"missing-peer error: k26 fused all-reduce: rank 0 waited 2 s for rank [1-9]", texts[0])
    for r, t in enumerate(texts):
        assert f"rank {r} mismatch error: k26 fused all-reduce: rank " in t, t
        assert "a different size" in t


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("world", [2, 4])
def test_fused_allreduce_ranks_time_sliced_on_one_gpu_match_reference(world, tmp_path):
    """ONE DEVICE, several processes: a protocol check, not a speed measurement."""
    replays = int(os.environ.get("K26_AR_REPLAYS", "1000"))
    _assert_ranks(run_ranks(world, replays, False, tmp_path), world)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fused_allreduce_two_gpus_10000_replays_bit_identical(tmp_path):
    replays = int(os.environ.get("K26_AR_REPLAYS", "10000"))
    _assert_ranks(run_ranks(2, replays, True, tmp_path, timeout=1800), 2)


if __name__ == "__main__":
    r, w, port, out, n, devs = sys.argv[1:7]
    worker(int(r), int(w), int(port), out, int(n), bool(int(devs)))
