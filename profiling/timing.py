"""Timing helpers shared by the kernel benchmarks: ceilings measured in the same run (eager copy
bandwidth, bf16 GEMM rate, the mma.sync peak) and CUDA-graph replay times with a cold L2.

Cold L2: a weight- or KV-streaming kernel timed back to back re-reads its bytes from the 50-60 MB L2, so
between replays a 256 MB buffer is read (outside the timed events) and each replay is timed alone. Read,
not written: a written flush leaves the L2 full of dirty lines whose write-backs the timed kernel would pay.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

FLUSH_BYTES = 256 << 20
SPIN_CYCLES = 1 << 20  # ~0.5 ms at the H200's clocks: longer than a 61-layer graph's launch on the host


def source_commit() -> str:
    """The commit a benchmark runs: K26_COMMIT (profiling/ab.sh sets it), else the COMMIT file of a snapshot
    (profiling/snapshot.sh: a tree without .git), else the checkout's HEAD, else ''."""
    root = Path(__file__).resolve().parents[1]
    if os.environ.get("K26_COMMIT"):
        return os.environ["K26_COMMIT"]
    if (root / "COMMIT").is_file():
        return (root / "COMMIT").read_text().strip()
    git = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, check=False, capture_output=True, text=True, cwd=root).stdout.strip()


def copy_bandwidth() -> float:
    """Read + write bytes per second of an eager 2 GiB device copy, after the clocks are up."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def build_cu(source: str, name: str, includes: tuple[str, ...] | list[str] = ()) -> ctypes.CDLL:
    """A benchmark's own CUDA source compiled with nvcc for this GPU and loaded (cached in the temp
    directory by name, arch and the hash of the source and of every header in `includes`, the -I folders)."""
    cc = "".join(map(str, torch.cuda.get_device_capability()))
    arch = f"sm_{cc}a" if cc in ("90", "100", "120") else f"sm_{cc}"
    digest = hashlib.sha256(source.encode())
    for d in includes:
        for h in sorted(Path(d).glob("*.cuh")):
            digest.update(h.read_bytes())
    so = Path(tempfile.gettempdir()) / f"k26_{name}_{arch}_{digest.hexdigest()[:12]}.so"
    if not so.exists():
        cu = so.with_suffix(".cu")
        cu.write_text(source)
        gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
        tmp = f"{so}.{os.getpid()}.tmp"
        flags = [
            "-O3",
            "-std=c++17",
            "-shared",
            "-Xcompiler",
            "-fPIC",
            gencode,
            *(f"-I{d}" for d in includes),
        ]
        subprocess.run(["nvcc", *flags, "-o", tmp, str(cu)], check=True)
        os.replace(tmp, so)
    return ctypes.CDLL(str(so))


def mma_sync_peak() -> float:
    """bf16 mma.sync FLOP/s of this GPU (profiling/mma_peak.cu, compiled here with nvcc)."""
    lib = build_cu(Path(__file__).with_name("mma_peak.cu").read_text(), "mma_peak")
    lib.k26_mma_peak_launch.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    out = torch.zeros(1, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, threads, iters = 8 * sms, 256, 4096
    stream = torch.cuda.current_stream().cuda_stream

    def run():
        assert lib.k26_mma_peak_launch(out.data_ptr(), blocks, threads, iters, stream) == 0

    for _ in range(3):
        run()
    t = events_time(run, 10)
    return blocks * threads // 32 * iters * 8 * 2 * 16 * 8 * 16 / t


def gemm_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * 8192**3 / events_time(lambda: a @ b, 10)


def events_time(fn, reps: int = 20) -> float:
    """Median seconds of fn() measured with CUDA events. A spin kernel ahead of the start event keeps the GPU
    busy while the host submits fn's work (a graph launch's host time fell inside the window on an idle
    stream; graph_time_cold's flush does the same for its replays)."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn warmed up on a side stream, then captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_time(fn, calls: int) -> float:
    """Median seconds per op call of a captured fn (which performs `calls` op calls), replayed warm."""
    return events_time(capture(fn).replay) / calls


def graph_time_cold(fn, calls: int = 1, reps: int = 30) -> float:
    """Median seconds per op call of a captured fn, each replay after reading FLUSH_BYTES (cold L2)."""
    g = capture(fn)
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    times = []
    for _ in range(reps):
        flush.sum()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times) / calls


def report(text: str, out: str | None) -> None:
    """Print the results table and, with --out, write it (folders made)."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
