"""Does a kernel change leave the machine code as it was? Compiles CUDA sources from the working tree and from
a git revision, for each arch and define set, and compares every function's SASS instruction stream. For a
refactor made on a machine without a GPU: identical SASS is identical behaviour and speed, no device run
needed (mla_tree_attn_kernel.cuh's split, 2026-12-08: every function of six builds x two archs identical).

    python scripts/sass_same.py k26/ops/csrc/mla_tree_attn.cu [--rev HEAD] [--arch sm_90a,sm_120a]
        [--variant K26_ATTN_NO_BATCH] [--variant K26_ATTN_WIDE,K26_ATTN_MERGE_LOADS_32=24] ...

The default build is always compared; each --variant adds a build with its comma-separated defines.

Exit status 0 when every function of every build matches, 1 otherwise (the differing ones are listed). The
comparison is of opcodes and operands in order (addresses and encodings left out); a function present on one
side only counts as a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sass_schedule import instructions, kernel_sass

ROOT = Path(__file__).resolve().parents[1]

# An anonymous namespace's (or a file-local symbol's) mangled name carries hashes of the source's path and of
# the compiling process: the two trees' would never match. c++filt's "(anonymous namespace)" has none; a name
# it cannot demangle loses them by pattern.
HASHED = re.compile(r"(_GLOBAL__N_|_INTERNAL_)_?\w*?_cu_[0-9a-f]{8}(_\d+)?")


def unhashed(names: list[str]) -> list[str]:
    if shutil.which("c++filt") is None:
        demangled = names
    else:
        filt = subprocess.run(["c++filt", *names], capture_output=True, text=True, check=True)
        demangled = filt.stdout.split("\n")
    return [d if d != n else HASHED.sub(r"\1", n) for n, d in zip(names, demangled, strict=False)]


def functions(source: Path, arch: str, defines: list[str]) -> dict[str, str]:
    """{function name (demangled where c++filt can): digest of its instruction stream} of one source's cubin,
    compiled by sass_schedule.kernel_sass (defines as NAME[=VALUE])."""
    sass = kernel_sass(source, "", arch, defines)
    streams = ("\n".join(f"{op}{args}" for _, op, args in instructions(body)) for body in sass.values())
    digests = [hashlib.sha256(stream.encode()).hexdigest()[:16] for stream in streams]
    return dict(zip(unhashed(list(sass)), digests, strict=True)) if sass else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", type=Path, help="CUDA sources, relative to the repository root")
    ap.add_argument("--rev", default="HEAD", help="the revision to compare the working tree against")
    ap.add_argument("--arch", default="sm_90a,sm_120a")
    ap.add_argument("--variant", action="append", default=[], help="NAME[=VALUE],...: a build with them")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        old_tree = tmp / "old"
        old_tree.mkdir()
        git = ["git", "-C", str(ROOT), "archive", a.rev, "k26/ops/csrc"]
        archive = subprocess.run(git, capture_output=True, check=False)
        if archive.returncode:
            sys.exit(f"git archive {a.rev} failed: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive.stdout, check=True)
        differ, total = [], 0
        for src in a.sources:
            for arch in a.arch.split(","):
                for dset in ["", *a.variant]:
                    defines = [d for d in dset.split(",") if d]
                    try:
                        new = functions(ROOT / src, arch, defines)
                        old = functions(old_tree / src, arch, defines)
                    except RuntimeError as e:  # nvcc's message, which names the source
                        sys.exit(f"{src} ({arch} {dset or 'default'}): {e}")
                    for name in sorted(set(new) | set(old)):
                        total += 1
                        if new.get(name) != old.get(name):
                            differ.append(f"{src.name} {arch} [{dset or 'default'}] {name}")
    print(f"{total - len(differ)} of {total} functions identical to {a.rev}")
    for d in differ:
        print(f"  differs: {d}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
