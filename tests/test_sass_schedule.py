"""The PDL load order in the kernels' SASS (scripts/sass_schedule.py: nvcc + the cuobjdump Triton ships,
no GPU). ptxas moves non-coherent .nc loads across griddepcontrol.wait (ACQBULK in SASS): an .nc load of the
previous kernel's output can be hoisted above it (a race: the sm_120a build of the deep tile-mode linear
kernels had one until 2026-12-05), and .nc weight loads meant to be in flight across it are sunk below it.
Checked: in every tile-mode linear kernel, on both archs, nothing but weight loads precede the wait, and the
weight batches do (coherent loads, since 2026-12-05)."""

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
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


def loads_around_wait(events: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """({load opcode: how many} before a schedule's first grid-dependency wait, the same after it), from its
    "  16 LDG.E.NA.128" lines. In address order: a kernel whose branches each wait (mla_glue_linear's kv half
    and tile path) is split at the first branch's wait (telling a later branch's prologue from the first's
    post-wait code needs the control-flow graph)."""
    pairs = [(int(n), op) for n, op in (e.split() for e in events)]
    ops = [op for _, op in pairs]
    assert "ACQBULK" in ops, "the kernel has no grid-dependency wait"
    at = ops.index("ACQBULK")
    sides: tuple[dict[str, int], dict[str, int]] = ({}, {})
    for i, (n, op) in enumerate(pairs):
        if op.startswith("LDG") and i != at:
            side = sides[i > at]
            side[op] = side.get(op, 0) + n
    return sides


def loads_before_wait(events: list[str]) -> dict[str, int]:
    return loads_around_wait(events)[0]


def loads_after_wait(events: list[str]) -> dict[str, int]:
    return loads_around_wait(events)[1]


@pytest.fixture(scope="module")
def every_kernel():
    """{(arch, source, kernel): schedule} of every kernel of k26/ops/csrc on both archs (default build)."""
    jobs = [(arch, src) for arch in ("sm_90a", "sm_120a") for src in sorted(CSRC.glob("*.cu"))]

    def run(job):
        arch, src = job
        return {
            (arch, src.name, k): ev for k, ev in sass_schedule.kernel_schedules(src, "", arch, ()).items()
        }

    with ThreadPoolExecutor(2) as pool:
        return {k: v for found in pool.map(run, jobs) for k, v in found.items()}


def pick(every_kernel, arch, source, kernel):
    return {k[2]: ev for k, ev in every_kernel.items() if k[0] == arch and k[1] == source and kernel in k[2]}


def tile_kernels(every_kernel, arch):
    """The small-M linear's tile-mode kernels: the plain ones and the SwiGLU ones (the same loop), each MT 1 /
    2 / 4 / 8 and the deep MT 1 / 2."""
    plain = pick(every_kernel, arch, "linear_smallm.cu", "linear_tile_kernel")
    swiglu = pick(every_kernel, arch, "linear_smallm.cu", "linear_swiglu_kernel")
    assert len(plain) == len(swiglu) == 6, (list(plain), list(swiglu))
    return plain | swiglu


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_tile_linear_kernels_read_x_only_after_the_wait(every_kernel, arch):
    found = tile_kernels(every_kernel, arch)
    assert len(found) >= 12, list(found)  # MT 1 / 2 / 4 / 8 and the deep MT 1 / 2, plain and SwiGLU
    for name, events in found.items():
        counts = loads_before_wait(events)
        assert set(counts) <= {"LDG.E.NA.128", "LDG.E.NA.128.CONSTANT"}, (name, counts)  # weights only


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize(
    "source, kernel, weight_loads",
    [
        ("linear_smallm.cu", "linear_tile_kernelILi1ELi4ELi1E", 16),  # deep: 2 batches x 4 units x 2 rows
        ("linear_smallm.cu", "linear_tile_kernelILi1ELi2ELi2E", 8),
        ("linear_smallm.cu", "linear_tile_kernelILi2ELi2ELi2E", 8),
        ("linear_smallm.cu", "linear_swiglu_kernelILi1ELi4ELi1E", 16),  # the SwiGLU kernels: the same loop
        ("linear_smallm.cu", "linear_swiglu_kernelILi1ELi2ELi2E", 8),
        ("add_rmsnorm.cu", "add_rmsnorm_kernel", 4),  # the norm weight: a thread's 4 vectors
        ("allreduce_fused.cu", "allreduce_add_rmsnorm_kernel", 4),
        ("mla_tree_attn.cu", "merge_uv_kernelILi2E", 4),  # W_UV: a lane's 2 rows x 2 vectors (32-row blocks)
    ],
)
def test_weights_are_loaded_before_the_wait_and_x_after(every_kernel, arch, source, kernel, weight_loads):
    found = pick(every_kernel, arch, source, kernel)
    assert len(found) == 1, list(found)
    counts = loads_before_wait(next(iter(found.values())))
    # weights: LDG.E.NA.128 (no L1 allocation) in the linear kernels, a strong 128-bit load of the norm weight
    assert sum(counts.values()) >= weight_loads, counts
    if "linear" in source:  # nothing but weights before the wait: x (a strong GPU-scope load) comes after
        assert set(counts) == {"LDG.E.NA.128"}, counts


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_the_128_row_merge_uv_kernel_prefetches_w_uv_before_the_wait(every_kernel, arch):
    # Its blocks keep W_UV out of registers until the merge is done (64 of them would spill beside the merge's
    # loads): the rows go into L2 before the wait (prefetch: CCTL.E.PF2), no wide load precedes it.
    found = pick(every_kernel, arch, "mla_tree_attn.cu", "merge_uv_kernelILi8E")
    assert len(found) == 1, list(found)
    (schedule,) = found.values()
    events = [e.split() for e in schedule]
    at = [op for _, op in events].index("ACQBULK")
    assert sum(int(n) for n, op in events[:at] if op.startswith("CCTL") and "PF" in op) >= 2, events[:at]
    assert not [op for op in loads_before_wait(schedule) if ".128" in op]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_tile_linear_kernels_read_x_through_l1(every_kernel, arch):
    # x through L1 (ld.global.ca: LDG.E.128.STRONG.SM), so the blocks sharing an SM fetch its lines from L2
    # once (o_proj at M = 16 9.55 -> 8.76 µs on an H100, 2026-12-07); the weights bypass L1 (LDG.E.NA.128).
    found = tile_kernels(every_kernel, arch)
    assert len(found) >= 12, list(found)
    for name, events in found.items():
        wide = {op for op in loads_after_wait(events) if ".128" in op}
        assert wide == {"LDG.E.NA.128", "LDG.E.128.STRONG.SM"}, (name, wide)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_the_moe_expert_kernels_read_activations_through_l1(every_kernel, arch):
    # The routed groups' x / act loads after the wait go through L1 (csrc/moe_mma.cuh ld_act; the verify step
    # with skewed routing 6.25 -> 6.13 ms on an H100, 2026-12-07): every register-fed expert GEMM has some.
    # (The staged one-token down copies act by cp.async; the shared expert's x stays L2-only.)
    found = {
        k: ev
        for k, ev in pick(every_kernel, arch, "moe_w4a16.cu", "").items()
        if ("gemm_kernel" in k or "down_combine" in k) and "staged" not in k
    }
    assert len(found) >= 8, list(found)
    for name, events in found.items():
        assert loads_after_wait(events).get("LDG.E.128.STRONG.SM", 0) >= 2, name  # a chunk: two 16-byte loads


def test_no_kernel_reads_a_vector_through_the_nc_path_before_its_wait(every_kernel):
    # A 64- / 128-bit .nc load (LDG.E.64 / 128.CONSTANT, not the weights' LDG.E.NA) ahead of the wait is how
    # a hoisted read of the previous kernel's output shows (the tile linears' x on sm_120a until 2026-12-05);
    # the 32-bit .nc loads some kernels issue early are constants or, in the MoE down kernels, the router's
    # weights two kernels back (csrc/moe_one_token.cuh says why those are complete).
    waits = 0
    for (arch, src, kernel), events in every_kernel.items():
        if not any(e.split()[1] == "ACQBULK" for e in events):
            continue
        waits += 1
        early = loads_before_wait(events)
        assert not {"LDG.E.128.CONSTANT", "LDG.E.64.CONSTANT"} & set(early), (arch, src, kernel, early)
    assert waits >= 40, waits  # every PDL kernel of both builds was looked at


def test_the_hot_loop_of_the_verify_tile_holds_its_key_intervals_mmas():
    # A 16-key interval of the 32-row tile: S over the warp's dim quarter for two m-tiles (2 x 9 mma) and
    # P V over its 64 value columns for two m-tiles (2 x 8): 34, and nothing else of the kernel is a loop
    # with more.
    (sass,) = sass_schedule.kernel_sass(CSRC / "mla_tree_attn.cu", "tree_attn_kernelILi2ELb1E").values()
    n, hmma, mix = sass_schedule.hot_loop(sass)
    assert hmma == 34 and mix["HMMA"] == 34 and mix["BAR"] == 1 and 34 < n < 1000


def test_the_hot_loop_is_the_innermost_of_those_holding_the_most_mmas():
    # The one-token MoE gate/up kernels nest their mma loop in another: the hot loop is the inner one.
    found = sass_schedule.kernel_sass(CSRC / "moe_w4a16.cu", "gemm_kernel")
    nested = 0
    for sass in found.values():
        bodies = [(len(b), sum(op.startswith("HMMA") for op in b)) for b in sass_schedule.loops(sass)]
        most = max((h for _, h in bodies), default=0)
        if most == 0:
            continue
        n, hmma, _ = sass_schedule.hot_loop(sass)
        same = sorted(length for length, h in bodies if h == most)
        assert (n, hmma) == (same[0], most)
        nested += len(same) > 1
    assert nested, "no kernel of moe_w4a16.cu nests its mma loop: the test checks nothing"
