"""A kernel's load / multiply schedule from its SASS, on a machine without a GPU: how many global loads a warp
has in flight before it first waits on them is ptxas's choice, not the source's (a source round of U loads
may be pipelined three deep), and it decides a streaming kernel's speed.

    python scripts/sass_schedule.py k26/ops/csrc/moe_w4a16.cu gemm_kernelILi1ELi1ELi8 [--arch A] [-D N] [-I D]

Compiles the file to a cubin with nvcc (k26/ops/build.py's flags, plus -D defines), disassembles it with the
cuobjdump that Triton ships (triton/backends/nvidia/bin; the CUDA toolkit here has none) and prints, for each
kernel whose mangled name contains the pattern, its instruction stream reduced to the scheduling events —
global loads (by cache policy), shared loads / stores, cp.async, L2 prefetches (CCTL), mma, barriers,
branches — with repeats counted: "8 LDG.E.EF.128" then "32 HMMA" is a round of 8 weight loads issued before
the first multiply.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

EVENTS = re.compile(r"(LDG|LDS|LDSM|STS|STG|LDGSTS|HMMA|BAR|BRA|WARPSYNC|ACQBULK|DEPBAR|CCTL)\b")


def cuobjdump_path() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def cuobjdump() -> Path:
    tool = cuobjdump_path()
    if not tool.exists():
        sys.exit(f"no cuobjdump at {tool}: install triton (it ships one) or the CUDA toolkit's")
    return tool


def schedule(sass: str) -> list[str]:
    """The scheduling events of one function's SASS, consecutive repeats counted ("8 LDG.E.EF.128")."""
    out: list[tuple[int, str]] = []
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not m or not EVENTS.match(m.group(2)) or (m.group(1) or "").strip() in ("@!PT", "@!UPT"):
            continue  # (@!PT / @!UPT: never executed, ptxas's padding)
        op = m.group(2)
        if out and out[-1][1] == op:
            out[-1] = (out[-1][0] + 1, op)
        else:
            out.append((1, op))
    return [f"{n:4d} {op}" for n, op in out]


def kernel_schedules(
    source: Path, pattern: str, arch: str = "sm_90a", defines=(), includes=()
) -> dict[str, list[str]]:
    """{mangled kernel name: schedule} of the kernels of `source` whose name contains `pattern`, compiled with
    nvcc for `arch` with `defines` and the -I folders `includes`; raises RuntimeError when nvcc fails."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cmd = ["nvcc", "-O3", "-std=c++17", f"-arch={arch}", "-cubin", "-o", str(cubin), str(source)]
        flags = [*(f"-D{d}" for d in defines), *(f"-I{d}" for d in includes)]
        proc = subprocess.run([*cmd, *flags], capture_output=True, text=True, check=False)
        if proc.returncode:
            raise RuntimeError(f"nvcc failed:\n{proc.stderr}")
        dump = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    out = {}
    for f in re.split(r"\n\s*Function : ", dump.stdout)[1:]:
        name, body = f.split("\n", 1)
        if pattern in name:
            out[name.strip()] = schedule(body)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("pattern", help="a substring of the kernel's mangled name")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a define, as nvcc's -D")
    ap.add_argument(
        "-I", dest="includes", action="append", default=[], help="an include folder, as nvcc's -I"
    )
    a = ap.parse_args()
    if not a.source.exists():
        sys.exit(f"no such source: {a.source}")
    try:
        found = kernel_schedules(a.source, a.pattern, a.arch, a.defines, a.includes)
    except RuntimeError as e:
        sys.exit(str(e))
    if not found:
        sys.exit(f"no kernel name of {a.source} contains {a.pattern!r}")
    for name, events in found.items():
        print(f"== {name}")
        print("\n".join(events))


if __name__ == "__main__":
    main()
