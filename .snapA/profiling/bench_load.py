"""Start-up at K2.6 width: write a full-width K2.6-layout checkpoint of a few layers (load_ckpt.py), drop
the page cache, measure the disk (dd of one shard), then load + repack as TP ranks: alone (one rank at a
time, its own bytes; the first writes its load-cache entry and starts again from it, cold), `LLM` with its
graph bucket set captured at start-up (CUDA), and coordinated (all ranks at once on gloo, each shard read
by one rank); extrapolate to 61 layers on 8 ranks (modelled, labelled so).

    python profiling/bench_load.py --tp 8 --alone-ranks 0 --capture --coordinated --results DIR
    python profiling/bench_load.py --repack-only      # the repack's speed alone (TP8 shapes, 384 experts)

Writes bench_load.md and .json to --results after every row."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_ckpt import K26, K26_BYTES, make, sync, write_checkpoint

from k26.loader import load_model
from k26.model import TPInfo
from k26.ops.moe_layout import repack_experts
from k26.shard_reader import io_read_bytes


def drop_cache(files: list[Path]) -> str:
    """Drop the page cache of `files` (posix_fadvise DONTNEED after a sync). Not the whole host's
    (drop_caches): that also evicts torch's own code pages, whose faults then count as disk reads of the
    load in /proc/self/io (measured: 0.28-0.36 GB per process)."""
    subprocess.run(["sync"], check=False)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return "fadvise DONTNEED of the checkpoint's files"


def dd_gbps(f: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M"], check=True, capture_output=True)
    return f.stat().st_size / (time.perf_counter() - t0) / 1e9


def repack_time(tp: int, dev: str) -> tuple[float, bool]:
    """One MoE layer's repack at this TP's shard shapes (384 experts), best of 3; GPU == CPU on 4 experts."""
    D, F, E = K26["hidden_size"], K26["moe_intermediate_size"] // tp, K26["n_routed_experts"]
    ex = [
        make("words", (E, F, D // 8), dev),
        make("scale", (E, F, D // 32), dev),
        make("words", (E, F, D // 8), dev),
        make("scale", (E, F, D // 32), dev),
        make("words", (E, D, F // 8), dev),
        make("scale", (E, D, F // 32), dev),
    ]
    small = [t[:4].cpu() for t in ex]
    same = all(
        torch.equal(a.cpu(), b)
        for a, b in zip(repack_experts(*[t[:4] for t in ex]), repack_experts(*small), strict=True)
    )
    best = float("inf")
    for _ in range(3 if dev.startswith("cuda") else 1):
        sync(dev)
        t0 = time.perf_counter()
        repack_experts(*ex)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best, same


def load_rank(path: Path, rank: int, tp: int, dev: str, group=None, cache_dir: Path | None = None) -> dict:
    """One rank's load, then its repack timed apart (`Int4Experts.repack_`, what `use_cuda_kernels` runs,
    without building the kernel library, which the load does not need). `own`: the bytes of the rank's
    own parameters (its TP slices, checkpoint layout: what a load-cache entry holds)."""
    from k26.model.moe import Int4Experts

    io0, t0 = io_read_bytes(), time.perf_counter()
    model = load_model(
        path,
        device=dev,
        tp=TPInfo(rank, tp),
        progress=False,
        group=group,
        cuda_kernels=False,
        cache_dir=cache_dir,
    )
    sync(dev)
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    t1 = time.perf_counter()
    for m in model.modules():
        if isinstance(m, Int4Experts):
            m.repack_()
    sync(dev)
    t2, io1 = time.perf_counter(), io_read_bytes()
    st = model.load_stats
    del model
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    disk = None if io0 is None or io1 is None else io1 - io0
    return {
        "rank": rank,
        "load_s": t1 - t0,
        "read_s": st.seconds,
        "bytes": st.bytes_read,
        "repack_s": t2 - t1,
        "wall": t2 - t0,
        "disk": disk,
        "own": own,
        "from_cache": st.from_cache,
    }


def _coordinated_rank(rank: int, tp: int, path: str, port: int, out: str, dev: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    dist.barrier()
    r = load_rank(Path(path), rank, tp, dev, dist.group.WORLD)
    Path(out, f"coord{rank}.json").write_text(json.dumps(r))
    dist.destroy_process_group()


def coordinated(path: Path, tp: int, out: Path, dev: str) -> list[dict]:
    import torch.multiprocessing as mp

    for f in out.glob("coord*.json"):
        f.unlink()
    mp.spawn(_coordinated_rank, args=(tp, str(path), 29650, str(out), dev), nprocs=tp, join=True)
    return [json.loads((out / f"coord{r}.json").read_text()) for r in range(tp)]


class Rows:
    """The result table, rewritten to --results after every row (a run cut short keeps what it measured)."""

    def __init__(self, res: Path, device: str):
        self.res, self.rows, self.data = res, [], {}
        self.dev = (
            torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
        )

    def add(self, what: str, value: str) -> None:
        self.rows.append((what, value))
        print(f"| {what} | {value} |", flush=True)
        lines = [
            f"# bench_load — {time.strftime('%Y-%m-%d')}",
            "",
            f"- device: {self.dev}; torch {torch.__version__}",
            f"- command: `python profiling/bench_load.py {' '.join(sys.argv[1:])}`",
            "",
            "| what | value |",
            "|---|---|",
        ] + [f"| {k} | {v} |" for k, v in self.rows]
        (self.res / "bench_load.md").write_text("\n".join(lines) + "\n")
        (self.res / "bench_load.json").write_text(json.dumps({"rows": self.rows} | self.data, indent=1))


def run_alone(a, out: Path, files: list[Path], dd: float, cache: Path, t: Rows) -> list[dict]:
    """Each rank of --alone-ranks alone, cold; the first also writes its load-cache entry, and then starts
    a second time, cold, from that entry (it must read only its own bytes)."""
    alone = []
    for i, r in enumerate(int(x) for x in a.alone_ranks.split(",") if x):
        drop_cache(files)
        x = load_rank(out, r, a.tp, a.device, cache_dir=cache if i == 0 else None)
        alone.append(x)
        gbps = x["bytes"] / x["read_s"] / 1e9
        disk = "n/a" if x["disk"] is None else f"{x['disk'] / 1e9:.2f} GB"
        t.add(
            f"alone, rank {r} of {a.tp}, cold: read {x['bytes'] / 1e9:.2f} GB (disk {disk}) in "
            f"{x['read_s']:.2f} s, {gbps:.2f} GB/s = {gbps / dd:.0%} of dd; "
            f"repack {a.layers - 1} MoE layer(s) {x['repack_s']:.2f} s",
            f"{x['wall']:.1f} s" + (" (writing its load-cache entry too)" if i == 0 else ""),
        )
        if i == 0:
            drop_cache(files + sorted(cache.rglob("*.safetensors")))
            y = load_rank(out, r, a.tp, a.device, cache_dir=cache)
            disk = "n/a" if y["disk"] is None else f"{y['disk'] / 1e9:.2f} GB = {y['disk'] / y['own']:.3f}x"
            t.add(
                f"second start, rank {r} of {a.tp}, cold, from the load cache ({y['from_cache']}): read "
                f"{y['bytes'] / 1e9:.3f} GB = {y['bytes'] / y['own']:.4f}x its own parameters' "
                f"{y['own'] / 1e9:.3f} GB (disk {disk}) in {y['read_s']:.2f} s",
                f"{y['wall']:.1f} s",
            )
            t.data["cache_start"] = y
    t.data["alone"] = alone
    return alone


def run_coordinated(a, out: Path, files: list[Path], size: int, t: Rows) -> None:
    drop_cache(files)
    t0 = time.perf_counter()
    cs = coordinated(out, a.tp, Path(tempfile.mkdtemp()), a.coord_device)  # not --results: 8 files
    wall = time.perf_counter() - t0
    total = sum(c["bytes"] for c in cs)
    disk = sum(c["disk"] or 0 for c in cs)
    slow = max(c["wall"] for c in cs)
    t.data["coordinated"] = cs
    t.add(
        f"coordinated, {a.tp} ranks on gloo, all on {a.coord_device}, cold: bytes read all ranks "
        f"{total / 1e9:.2f} GB = {total / size:.2f}x checkpoint (disk {disk / 1e9:.2f} GB = "
        f"{disk / size:.2f}x); slowest rank load {slow:.1f} s",
        f"{wall:.1f} s incl. spawn",
    )


def capture_set(llm, spec) -> float:
    """Seconds to capture `spec`'s whole bucket set (greedy + sampled graphs of every batch size), the
    adaptive budget's cost calibration included (start-up pays it too)."""
    t0 = time.perf_counter()
    llm.capture(spec)
    return time.perf_counter() - t0


def run_capture(a, out: Path, dd: float, t: Rows) -> dict:
    """`LLM` on the written checkpoint (TP 1: one GPU, its whole checkpoint read file by file as a
    coordinated rank reads its files), its AR bucket set captured at start-up; and on the embedded tiny
    pair the DDTree bucket set (its cost beyond the layers: budget policies, calibration, tree kernels)."""
    import statistics

    import k26

    t0 = time.perf_counter()
    llm = k26.LLM(out, device=a.device, max_batch=8, max_model_len=4096, capture=True, progress=False)
    wall = time.perf_counter() - t0
    st = llm.startup
    per = ", ".join(f"b{c.bucket.batch} {c.kind[3:]} {c.seconds:.2f} s" for c in st.captures)
    seq = st.bytes_read / st.phases["read"] / 1e9
    pool = sum(c.pool_bytes for c in st.captures)
    t.add(
        f"LLM start-up on this checkpoint, TP1 (whole layers on one GPU), graphs: read "
        f"{st.bytes_read / 1e9:.2f} GB in {st.phases['read']:.1f} s ({seq:.2f} GB/s = {seq / dd:.0%} of dd), "
        f"repack {st.phases.get('repack', 0):.2f} s, capture of {len(st.captures)} AR graphs "
        f"{st.phases.get('capture', 0):.2f} s ({per}); pool {pool / 1e6:.0f} MB",
        f"{wall:.1f} s",
    )
    # the first graph also pays the one-time allocations and kernel loads; the rest scale with launches
    steady = statistics.median(c.seconds for c in st.captures[1:]) if len(st.captures) > 1 else float("nan")
    t.data["captures"] = [
        [c.kind, c.bucket.batch, c.bucket.nodes, c.seconds, c.pool_bytes] for c in st.captures
    ]
    llm.close()
    del llm
    torch.cuda.empty_cache()
    tiny = k26.LLM(device=a.device, max_batch=8, progress=False)
    d = capture_set(tiny, k26.SpecConfig("ddtree"))
    graphs = len(tiny.startup.captures)
    r = capture_set(tiny, k26.SpecConfig("ar"))
    t.add(
        f"embedded tiny pair (6 layers + drafter): DDTree auto bucket set ({graphs} graphs: batch sizes x "
        f"budget candidates x sampling modes, budget calibration included) vs its AR set",
        f"{d:.2f} s vs {r:.2f} s",
    )
    t.data["tiny_captures"] = [
        [c.kind, c.bucket.batch, c.bucket.nodes, c.seconds, c.pool_bytes] for c in tiny.startup.captures
    ]
    tiny.close()
    return {"per_graph_layer": steady / a.layers, "seq_eff": seq / dd, "tiny_set": d, "graphs": graphs}


def model_rows(a, dd: float, alone: list[dict], rp: float, cap: dict | None) -> list[tuple[str, str]]:
    """K2.6 (594 GB, 60 MoE layers, 61 layers) on 8 ranks, each byte read once at --nvme GB/s: modelled
    from the rows above, not measured. Reads: a coordinated rank reads whole files in sequence, so at the
    efficiency of the whole-checkpoint read (the LLM row), else (no capture run) of the alone rank. Capture:
    host-bound (launches recorded), so per graph linear in layers: the DDTree set's graphs at the AR graphs'
    measured seconds per layer x 61 layers, plus what the tiny pair's DDTree set costs beyond its layers
    (an upper bound: that set also includes its own 6 layers)."""
    eff_alone = min(1.0, min(r["bytes"] / r["read_s"] / 1e9 / dd for r in alone)) if alone else 1.0
    eff = min(1.0, cap["seq_eff"]) if cap else eff_alone
    read = K26_BYTES / (a.nvme * 1e9 * eff)
    rep = 60 * rp
    if cap:
        capture = cap["tiny_set"] + cap["graphs"] * 61 * cap["per_graph_layer"]
        how = (
            f"{cap['graphs']} graphs x 61 layers x {cap['per_graph_layer'] * 1e3:.1f} ms per graph-layer "
            f"(measured, AR, full width) + {cap['tiny_set']:.1f} s (the tiny pair's whole DDTree set)"
        )
    else:
        capture, how = a.capture_s, "assumed (--capture-s), not measured"
    total = read + rep + capture
    return [
        (
            (
                f"read 594 GB once across 8 ranks at {a.nvme:.0f} GB/s x measured efficiency {eff:.2f} "
                f"(ranks reading alone: {eff_alone:.2f}, {K26_BYTES / (a.nvme * 1e9 * eff_alone):.0f} s)"
            ),
            f"{read:.0f} s",
        ),
        (f"repack, 60 MoE layers per rank (ranks in parallel), measured {rp:.3f} s/layer", f"{rep:.1f} s"),
        (f"graph capture of the DDTree bucket set at start-up, 61 layers: {how}", f"{capture:.0f} s"),
        (
            "modelled start-up to first token (all buckets captured first)",
            f"{total:.0f} s ({total / 60:.1f} min)",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/k26_load_ckpt")
    ap.add_argument("--cache-dir", default="/tmp/k26_load_cache")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--alone-ranks", default="0")
    ap.add_argument("--coordinated", action="store_true")
    ap.add_argument("--capture", action="store_true", help="LLM start-up with graph capture (CUDA)")
    ap.add_argument("--nvme", type=float, default=7.0)
    ap.add_argument(
        "--capture-s", type=float, default=60.0, help="capture seconds to model without --capture"
    )
    ap.add_argument("--results", default=os.environ.get("OUT", "."))
    ap.add_argument("--reuse", action="store_true", help="keep a checkpoint already in --out")
    ap.add_argument("--skip-repack-time", action="store_true")
    ap.add_argument("--repack-only", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", type=int, default=384, help="routed experts per layer (384: full width)")
    ap.add_argument("--coord-device", default=None, help="the coordinated ranks' device (default --device)")
    a = ap.parse_args()
    a.coord_device = a.coord_device or a.device
    out, res, cache = Path(a.out), Path(a.results), Path(a.cache_dir)
    res.mkdir(parents=True, exist_ok=True)
    t = Rows(res, a.device)
    rp, same = repack_time(a.tp, a.device) if not a.skip_repack_time else (float("nan"), None)
    t.add(
        f"repack of one MoE layer on {a.device}, TP{a.tp} shapes (384 experts; best of 3 on GPU); "
        f"equal to the CPU's on 4 experts: {same}",
        f"{rp * 1e3:.1f} ms",
    )
    if a.repack_only:  # seconds of device time: the repack's speed without the disk
        return
    if a.reuse and (out / "model.safetensors.index.json").is_file():  # a checkpoint this bench wrote before
        files = sorted(out.glob("*.safetensors"))
        size, wt = sum(f.stat().st_size for f in files), float("nan")
    else:
        size, wt = write_checkpoint(out, a.layers, a.shard_gb, a.device, a.experts)
        files = sorted(out.glob("*.safetensors"))
    t.add(
        f"checkpoint written: {a.layers} layers, {a.experts} experts, {len(files)} shards",
        f"{size / 1e9:.2f} GB in {wt:.1f} s",
    )
    how = drop_cache(files)
    dd = dd_gbps(max(files, key=lambda f: f.stat().st_size))
    t.add(f"dd of the largest shard, cold ({how})", f"{dd:.2f} GB/s")
    shutil.rmtree(cache, ignore_errors=True)  # the second start must use an entry this run wrote
    alone = run_alone(a, out, files, dd, cache, t)
    cap = run_capture(a, out, dd, t) if a.capture and a.device.startswith("cuda") else None
    for k, v in model_rows(a, dd, alone, rp, cap):
        t.add("MODELLED: " + k, v)
    if a.coordinated:  # last: the slowest part (8 processes, gloo over loopback), the rest is written by then
        run_coordinated(a, out, files, size, t)


if __name__ == "__main__":
    main()
