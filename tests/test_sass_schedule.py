"""The PDL load order in the kernels' SASS (scripts/sass_schedule.py: nvcc + the cuobjdump Triton ships,
no GPU). ptxas moves non-coherent .nc loads across griddepcontrol.wait (ACQBULK in SASS): an .nc load of the
previous kernel's output can be hoisted above it (a race: the sm_120a build of the deep tile-mode linear
kernels had one until 2026-12-05), and .nc weight loads meant to be in flight across it are sunk below it.
Checked: in every tile-mode linear kernel, on both archs, nothing but weight loads precede the wait; with
-DK26_PDL_ORDERED_LOADS the weight batches do."""

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sass_schedule

CSRC = ROOT / "k26" / "ops" / "csrc"
pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or not sass_schedule.cuobjdump_path().exists(),
    reason="needs nvcc and Triton's cuobjdump",
)


def loads_before_wait(events: list[str]) -> dict[str, int]:
    """{load opcode: how many} before a schedule's first grid-dependency wait ("  16 LDG.E.NA.128" lines)."""
    pairs = [(int(n), op) for n, op in (e.split() for e in events)]
    ops = [op for _, op in pairs]
    assert "ACQBULK" in ops, "the kernel has no grid-dependency wait"
    counts: dict[str, int] = {}
    for n, op in pairs[: ops.index("ACQBULK")]:
        if op.startswith("LDG"):
            counts[op] = counts.get(op, 0) + n
    return counts


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_tile_linear_kernels_read_x_only_after_the_wait(arch):
    found = sass_schedule.kernel_schedules(CSRC / "linear_smallm.cu", "linear_tile_kernel", arch)
    assert len(found) >= 6, list(found)  # MT 1 / 2 / 4 / 8 and the deep MT 1 / 2
    for name, events in found.items():
        counts = loads_before_wait(events)
        assert set(counts) <= {"LDG.E.NA.128", "LDG.E.NA.128.CONSTANT"}, (name, counts)  # weights only


@pytest.mark.parametrize(
    "source, kernel, weight_loads",
    [
        ("linear_smallm.cu", "linear_tile_kernelILi1ELi4ELi1E", 16),  # deep: 2 batches x 4 units x 2 rows
        ("linear_smallm.cu", "linear_tile_kernelILi1ELi2ELi2E", 8),
        ("linear_smallm.cu", "linear_tile_kernelILi2ELi2ELi2E", 8),
        ("add_rmsnorm.cu", "add_rmsnorm_kernel", 4),  # the norm weight: a thread's 4 vectors
    ],
)
def test_ordered_loads_issue_the_weights_before_the_wait_and_x_after(source, kernel, weight_loads):
    found = sass_schedule.kernel_schedules(CSRC / source, kernel, "sm_90a", ["K26_PDL_ORDERED_LOADS"])
    assert len(found) == 1, list(found)
    counts = loads_before_wait(next(iter(found.values())))
    # weights: LDG.E.NA.128 (no L1 allocation) in the linear kernels, a strong 128-bit load of the norm weight
    assert sum(counts.values()) >= weight_loads, counts
    if "linear" in source:  # nothing but weights before the wait: x (a strong GPU-scope load) comes after
        assert set(counts) == {"LDG.E.NA.128"}, counts
