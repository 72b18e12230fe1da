"""Build every CUDA source of k26 into one shared library with plain nvcc (no torch headers; a minute or two,
also on machines without a GPU), report registers / shared memory / spills per kernel, and load it.

    python -m k26.ops.build [--arch sm_90a,sm_120a] [--out DIR] [--variants]

Fails on any register spill and on more than 99 KB (101,376 B) of static shared memory for sm_120a,
sm_120's per-block limit; kernels with dynamic shared memory static_assert the same limit in source.
The library is cached under k26/ops/_build/ keyed by the sources' hash (a read-only install: the user's cache,
~/.cache/k26/ops; K26_OPS_BUILD overrides both).

K26_OPS_DEFINES (environment, e.g. "-DK26_MY_VARIANT"): preprocessor defines for a kernel variant's
A/B — part of the library's hash, so a variant builds to its own file and loads only where the variable is
set the same way (profiling/snapshot.sh passes it through).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"


def default_build_dir(pkg: Path = Path(__file__).parent) -> Path:
    """Where the library is cached: K26_OPS_BUILD, else `_build` beside the sources (a checkout or a user
    install), else the user's cache when the installed package is read-only (a system site-packages), so a
    wheel builds on first use instead of failing on a permission error."""
    if env := os.environ.get("K26_OPS_BUILD"):
        return Path(env)
    local = pkg / "_build"
    if os.access(local if local.exists() else pkg, os.W_OK):
        return local
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k26" / "ops"


BUILD_DIR = default_build_dir()
ARCHS = ("sm_90a", "sm_120a")
SM120_SMEM_LIMIT = 101_376  # 99 KB: the largest shared-memory block sm_120 can launch


class BuildError(RuntimeError):
    pass


@dataclass
class KernelReport:
    arch: str
    name: str
    registers: int = 0
    smem: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cu"))


def defines() -> list[str]:
    """K26_OPS_DEFINES as nvcc flags: -DNAME or -DNAME=VALUE only (a variant switch, not arbitrary flags)."""
    flags = os.environ.get("K26_OPS_DEFINES", "").split()
    bad = [f for f in flags if not re.fullmatch(r"-D[A-Za-z_]\w*(=[\w.+-]*)?", f)]
    if bad:
        raise BuildError(f"K26_OPS_DEFINES: {bad} are not -DNAME or -DNAME=VALUE defines")
    return flags


def library_path(archs: tuple[str, ...] = ARCHS) -> Path:
    h = hashlib.sha256()
    for src in sources() + sorted(CSRC.glob("*.cuh")):
        h.update(src.name.encode() + src.read_bytes())
    h.update(",".join(archs).encode())
    if extra := defines():  # (no defines: the same hash as before the variable existed)
        h.update(" ".join(extra).encode())
    return BUILD_DIR / f"libk26_ops-{h.hexdigest()[:16]}.so"


def _demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    # A failing demangler leaves stdout short: the names are then kept as they are.
    proc = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=False)
    out = proc.stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def parse_ptxas(log: str) -> list[KernelReport]:
    reports: list[KernelReport] = []
    cur: KernelReport | None = None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for '(\S+)'", line):
            cur = KernelReport(arch=m.group(2), name=m.group(1))
            reports.append(cur)
        elif cur and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            cur.spill_stores, cur.spill_loads = int(m.group(1)), int(m.group(2))
        elif cur and (m := re.search(r"Used (\d+) registers", line)):
            cur.registers = int(m.group(1))
            if s := re.search(r"(\d+) bytes smem", line):
                cur.smem = int(s.group(1))
    names = _demangle(sorted({r.name for r in reports}))
    for r in reports:
        r.name = names[r.name]
    return reports


def resource_problems(reports: list[KernelReport]) -> list[str]:
    """Spills anywhere, and more static shared memory than sm_120 launches."""
    problems = [
        f"{r.arch} {r.name}: {r.spill_stores} B spill stores / {r.spill_loads} B spill loads"
        for r in reports
        if r.spill_stores or r.spill_loads
    ]
    return problems + [
        f"{r.arch} {r.name}: {r.smem} B static shared memory > {SM120_SMEM_LIMIT}"
        for r in reports
        if r.arch.startswith("sm_120") and r.smem > SM120_SMEM_LIMIT
    ]


def _nvcc_cmd(archs: tuple[str, ...]) -> list[str]:
    """nvcc and the flags every k26 compile shares (the library's and the variants' checks)."""
    nvcc = shutil.which("nvcc") or (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    if not Path(nvcc).exists():
        raise BuildError("nvcc not found: install the CUDA toolkit or set CUDA_HOME to build k26's kernels")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    return [str(nvcc), "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xptxas", "-v", *gencode]


# The kernel variants kept in the sources behind a define for A/Bs (K26_OPS_DEFINES), each with the sources
# it changes: `--variants` compiles them for every arch under the same resource checks, so an off-by-default
# variant cannot rot unnoticed (CI runs it).
# (Measured and dropped: bf16 attention partials and 16-row attention tiles,
# profiling/results/2026-12-04-variants-session17-h200.md; the MoE down + combine's deal cost and the
# gate/up's warps a block, 2026-12-04-moe-gate-up-session18-h200.md; the MoE weights by ld.global.nc and the
# small-M linear's two-tile blocks, 2026-12-05-session22-h200.md; the one-token MoE gate/up's whole k range
# staged in shared memory and its blocks bounded to 2 an SM, 2026-12-05-session24-h200.md. Made the default:
# the coherent weight loads that keep PDL's prefetch above the wait, same file; the one-token MoE gate/up's
# x by cp.async and the table-driven gate/up's first weights prefetched,
# 2026-12-06-moe-variants-session28-h100.md; dropped: the wide attention tile's fast whole-tile copies,
# 2026-12-06-attn-wide-tile-session28-h100.md, and the union attention kernel's register cap (__maxnreg__
# 224 / 232: its 32-row shapes no faster), 2026-12-06-attn-union-step-session29-h100.md; the union's bodies as
# __noinline__ functions (slower on every shape: N = 16 at 4K 19.6 -> 22.4 µs, N = 64 at 128K 811 -> 910),
# and the shared expert's gate/up blocks L2-prefetching its down weights under the router (one-token block
# 26.1 -> 26.7 µs), 2026-12-06-moe-groups-tree-heap-session30-h100.md. Made the default: the vocabulary
# top-k's histogram a warp, 2026-12-06-topk-warp-hist-session33-h100.md. Dropped: the tree attention's tile
# loops L2-prefetching the tile 4 or 8 beyond each copy (decode at 128K 72.6 -> 84.5 / 102 µs; the 32-row
# tiles' 3 % at 32K-128K gone once gated to long splits), 2026-12-06-attn-l2-ahead-session34-h100.md; the
# 32-row tile on 16 warps (5-9 % slower everywhere) and O's rescale behind a warp-uniform vote (5-12 % slower:
# the branch splits the one-basic-block interval), 2026-12-06-attn-w16-session34-h100.md.)
VARIANTS: dict[str, list[str]] = {
    # tree attention: the key-loop bodies per row tile (csrc/mla_attn_common.cuh: bit MT - 1 of a mask; by
    # default one barrier a tile and row copies on the 32-row verify tiles only). ONE_BARRIER_MT=0: two
    # barriers a tile everywhere (the body before 2026-12-05, an A/B side); ROW_COPIES_MT=0: the strided
    # copies everywhere (measured 2026-12-05, H200: N = 16 / 64 at 32K 63.5 / 209 µs with row copies, 64.9 /
    # 217 without)
    "-DK26_ATTN_ONE_BARRIER_MT=0": ["mla_tree_attn.cu"],
    "-DK26_ATTN_ROW_COPIES_MT=0": ["mla_tree_attn.cu"],
    # tree attention, 16-row (decode) tiles: the tile loop (two barriers a 16-key tile) for every split, also
    # those of <= 4 tiles the default runs as one batch (csrc/mla_attn_common.cuh kBatch). Measured 2026-12-06
    # (H100): 4K decode 10.4 µs with it, 9.0 without (2026-12-06-attn-decode-batch-session33-h100.md)
    "-DK26_ATTN_NO_BATCH": ["mla_tree_attn.cu"],
    # tree attention: the running max moved only when a tile's max exceeds it by > 8 (O's rescale skipped):
    # measured 2026-12-05, no gain
    "-DK26_ATTN_LAZY_RESCALE": ["mla_tree_attn.cu"],
    # tree attention, 32-row tiles: 24 merge loads in flight a thread (default 8), one round at N = 16;
    # measured 2026-12-05: N = 16 at 4K 20.4 -> 19.9 µs, elsewhere unchanged
    "-DK26_ATTN_MERGE_LOADS_32=24": ["mla_tree_attn.cu"],
    # tree attention: 64-row tiles from N x H = 64 (csrc/mla_tree_attn_wide.cuh: each key tile feeds 64 rows,
    # the softmax in registers, O split over warp pairs). Measured 2026-12-06 (H100): N = 16 at 128K
    # 219 -> 184 µs, N = 64 at 32K 209 -> 184, but N = 16 at 4K 19.5 -> 24.7
    # (2026-12-06-attn-wide-tile-session28-h100.md)
    "-DK26_ATTN_WIDE": ["mla_tree_attn.cu"],
    # ... both verify tiles in one launch, the wide body for a sequence whose splits stream >= 1024 keys each
    # (csrc/mla_tree_attn_union.cuh: it wins at long contexts only, and a graph serves every length).
    # Measured 2026-12-06 (H100): N = 64 at 32K 209 -> 187 µs, N = 16 at 128K 219 -> 189, but the shapes left
    # on the 32-row body lose 1.5-7 % inside it (N = 16 at 32K 65.1 -> 68.6), at 224 registers too
    # (2026-12-06-attn-union-step-session29-h100.md). From 512 query rows only (K26_ATTN_UNION_MIN_ROWS,
    # session 30): N = 64 at 128K 817 -> 746, B = 4 N = 64 at 32K 844 -> 733, but H = 64 N = 64 at 4K
    # 200 -> 373 and N = 256 at 4K 115 -> 124 (2026-12-06-moe-groups-tree-heap-session30-h100.md)
    "-DK26_ATTN_UNION": ["mla_tree_attn.cu"],
    # tree attention + W_UV: the verify tree's 32-row tiles (up to 128 query rows a sequence) defer their
    # split merge to W_UV's kernel as one-tile decode does (csrc/mla_merge_uv.cuh, 128-row blocks): at 4K the
    # N = 16 attention's barrier + merge were ~8.5 of ~20 µs (session 18). Unmeasured (session 48: no device)
    "-DK26_ATTN_DEFER_VERIFY": ["mla_tree_attn.cu"],
    # MoE one token: gate/up warps L2-prefetch the rest of their k range behind the first register batch
    # (the second batch hits L2); bit-identical. Measured 2026-12-05 (H200, bench_moe --block): no gain (with
    # the staged down kernel, now the default, the block at one token 25.0 µs against 23.8 without it)
    "-DK26_MOE_GU_L2AHEAD": ["moe_w4a16.cu"],
    # MoE router, one token: no arrival count (partials in self-flagged 64-bit slots that block 0 polls: ~1
    # L2 round trip after the last store where the count + gather took 4), the top-k's second round by ranks;
    # bit-identical outputs (same sums, keys, tie order). Measured 2026-12-05 (H200): the router at one token
    # 7.7 µs against 6.7 by default: slower. One slot set per device: one router launch at a time (no
    # bounded spin), emptied before the next by the PDL chain's waits
    "-DK26_ROUTER_POLL": ["moe_router.cu"],
    # small-M linear, 9-16 tokens beyond one wave (o_proj, the lm_head shard): two 16-row tiles a warp, each x
    # fragment feeding both (half the x loads a weight byte); bit-identical. Prepared 2026-12-07, not measured
    "-DK26_LINEAR_RT2": ["linear_smallm.cu"],
    # the same from one token and in the SwiGLU mode, beyond one wave: the drafter's gate / up, down and
    # o_proj and the target's o_proj fit one wave (session 22's two-tile blocks, re-tried now that the weight
    # loads stay above the wait); bit-identical. Prepared 2026-12-07, not measured
    "-DK26_LINEAR_RT2_ALL": ["linear_smallm.cu"],
    # tree attention, a probe (wrong outputs: never a library anything but a bench loads): the splits store
    # their partials and leave, no barrier, no merge; the step's time then bounds what moving the merge into
    # W_UV's kernel (behind the kernel boundary the step pays anyway) could save. Measured 2026-12-07 (H100):
    # the 4K decode step 4.36 -> 4.07 ms, 4.8 µs a layer at most (2026-12-07-session39-h100.md)
    "-DK26_ATTN_PROBE_NO_MERGE": ["mla_tree_attn.cu"],
}


def check_variants(archs: tuple[str, ...] = ARCHS) -> list[str]:
    """Compile each variant's sources (objects in a temporary directory, no library); the problems found."""
    import tempfile

    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for define, names in VARIANTS.items():
            for name in names:
                obj = str(Path(tmp) / "v.o")
                cmd = [*_nvcc_cmd(archs), "-c", *define.split(), "-o", obj, str(CSRC / name)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode:
                    problems.append(f"{define} {name}: nvcc failed:\n{proc.stderr}")
                    continue
                problems += [f"{define} {p}" for p in resource_problems(parse_ptxas(proc.stderr))]
    return problems


def build(archs: tuple[str, ...] = ARCHS, out: Path | None = None, verbose: bool = True) -> Path:
    out = out or library_path(archs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"  # per process: ranks building at once never share a half-written file
    cmd = [*_nvcc_cmd(archs), "-shared", "-lineinfo", *defines(), "-o", tmp, *map(str, sources())]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)  # stderr goes into BuildError
    if proc.returncode:
        raise BuildError(f"nvcc failed:\n{' '.join(cmd)}\n{proc.stderr}")
    reports = parse_ptxas(proc.stderr)
    problems = resource_problems(reports)
    if verbose:
        print(f"{'arch':8s} {'regs':>5s} {'smem B':>7s} {'spill':>6s}  kernel")
        for r in reports:
            spills = r.spill_stores + r.spill_loads
            print(f"{r.arch:8s} {r.registers:5d} {r.smem:7d} {spills:6d}  {r.name[:110]}")
    if problems:
        Path(tmp).unlink(missing_ok=True)
        raise BuildError("kernel resource check failed:\n  " + "\n  ".join(problems))
    os.replace(tmp, out)  # atomic: a process loading `out` sees no half-written library
    return out


@functools.cache  # one load per process; `library.cache_clear()` forgets it (a failed load is not cached)
def library() -> ctypes.CDLL:
    """The loaded kernel library, built on first use if no cached build matches the sources."""
    path = Path(os.environ["K26_OPS_LIB"]) if "K26_OPS_LIB" in os.environ else library_path()
    shipped = Path(__file__).parent / "_build" / path.name  # (a read-only install's, built when installed)
    if not path.exists() and "K26_OPS_LIB" not in os.environ and shipped.exists():
        path = shipped
    if not path.exists():
        # TP ranks start together: one builds under the lock, the others find its library afterwards.
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                build(out=path, verbose=False)
    return ctypes.CDLL(str(path))  # each op's front door sets its entry points' signatures


@functools.cache
def available() -> bool:
    """Whether the kernel library loads (built or buildable here); warns once when it does not."""
    try:
        library()
        return True
    except (BuildError, OSError) as e:
        import warnings

        warnings.warn(
            f"k26: CUDA kernels unavailable ({e}); the pure-torch references run instead", stacklevel=2
        )
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k26.ops.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default=",".join(ARCHS), help="comma-separated SASS targets")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--variants", action="store_true", help="also compile the kept kernel variants")
    a = ap.parse_args(argv)
    archs = tuple(x.strip() for x in a.arch.split(",") if x.strip())
    try:
        path = build(archs, a.out or library_path(archs))
        problems = check_variants(archs) if a.variants else []
    except BuildError as e:
        print(f"k26.ops.build: {e}", file=sys.stderr)
        return 1
    print(f"built {path}")
    if problems:
        print("k26.ops.build: kernel variants failed:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if a.variants:
        print(f"variants compiled: {', '.join(VARIANTS) or 'none kept'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
