"""A kernel's load / multiply schedule from its SASS, on a machine without a GPU: how many global loads a warp
has in flight before it first waits on them is ptxas's choice, not the source's (a source round of U loads
may be pipelined three deep), and it decides a streaming kernel's speed.

    python scripts/sass_schedule.py k26/ops/csrc/moe_w4a16.cu gemm_kernelILi1ELi1ELi8 [--arch A] [-D N] [-I D]
    python scripts/sass_schedule.py k26/ops/csrc/mla_tree_attn.cu tree_attn_kernelILi2ELb1E --loop

Compiles the file to a cubin with nvcc (k26/ops/build.py's flags, plus -D defines), disassembles it with the
cuobjdump that Triton ships (triton/backends/nvidia/bin; the CUDA toolkit here has none) and prints, for each
kernel whose mangled name contains the pattern, its instruction stream reduced to the scheduling events —
global loads (by cache policy), shared loads / stores, cp.async, L2 prefetches (CCTL), mma, barriers,
branches — with repeats counted: "8 LDG.E.EF.128" then "32 HMMA" is a round of 8 weight loads issued before
the first multiply. `--loop`: the hot loop's instruction count and opcode mix (`hot_loop`), e.g. a key-loop
interval's cost of a kernel variant (-D), before any device time goes to it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
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


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """One function's SASS as (address, opcode, operands), ptxas's padding left out (NOP, and @!PT / @!UPT:
    never executed)."""
    out = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if m and m.group(3) != "NOP" and (m.group(2) or "").strip() not in ("@!PT", "@!UPT"):
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def schedule(sass: str) -> list[str]:
    """The scheduling events of one function's SASS, consecutive repeats counted ("8 LDG.E.EF.128")."""
    out: list[tuple[int, str]] = []
    for _, op, _ in instructions(sass):
        if not EVENTS.match(op):
            continue
        if out and out[-1][1] == op:
            out[-1] = (out[-1][0] + 1, op)
        else:
            out.append((1, op))
    return [f"{n:4d} {op}" for n, op in out]


def loops(sass: str) -> list[list[str]]:
    """Every loop of one function's SASS (a backward branch and the instructions from its target to it), each
    as its opcodes in address order (`instructions`). Nested loops are listed apart and again inside the loops
    around them."""
    ins = instructions(sass)
    at = {addr: i for i, (addr, _, _) in enumerate(ins)}
    out = []
    for i, (_, op, args) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        j = at.get(int(target.group(1), 16)) if target else None
        if j is not None and j <= i:
            out.append([o for _, o, _ in ins[j : i + 1]])
    return out


def hot_loop(sass: str) -> tuple[int, int, Counter]:
    """The innermost loop holding the most mma.sync (of those with as many, the fewest instructions: a loop
    around it holds its MMAs too): (instructions, HMMA among them, opcode counts without modifiers). What a
    key-loop interval costs in instructions, counted on the CPU machine before a variant goes to a GPU."""
    best = (0, 0, Counter())
    for body in loops(sass):
        hmma = sum(op.startswith("HMMA") for op in body)
        if hmma > best[1] or (hmma == best[1] and (best[0] == 0 or len(body) < best[0])):
            best = (len(body), hmma, Counter(op.split(".")[0] for op in body))
    return best


def kernel_sass(source: Path, pattern: str, arch: str = "sm_90a", defines=(), includes=()) -> dict[str, str]:
    """{mangled kernel name: SASS} of the kernels of `source` whose name contains `pattern`, compiled with
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
            out[name.strip()] = body
    return out


def kernel_schedules(
    source: Path, pattern: str, arch: str = "sm_90a", defines=(), includes=()
) -> dict[str, list[str]]:
    """{mangled kernel name: schedule} of the kernels `kernel_sass` finds."""
    return {k: schedule(v) for k, v in kernel_sass(source, pattern, arch, defines, includes).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("pattern", help="a substring of the kernel's mangled name")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a define, as nvcc's -D")
    ap.add_argument(
        "-I", dest="includes", action="append", default=[], help="an include folder, as nvcc's -I"
    )
    ap.add_argument("--loop", action="store_true", help="the hot loop's instruction count and mix instead")
    a = ap.parse_args()
    if not a.source.exists():
        sys.exit(f"no such source: {a.source}")
    try:
        found = kernel_sass(a.source, a.pattern, a.arch, a.defines, a.includes)
    except RuntimeError as e:
        sys.exit(str(e))
    if not found:
        sys.exit(f"no kernel name of {a.source} contains {a.pattern!r}")
    for name, sass in found.items():
        print(f"== {name}")
        if a.loop:
            n, hmma, mix = hot_loop(sass)
            print(
                f"hot loop: {n} instructions, {hmma} HMMA\n  "
                + ", ".join(f"{k} {v}" for k, v in mix.most_common())
            )
        else:
            print("\n".join(schedule(sass)))


if __name__ == "__main__":
    main()
