"""scripts/sass_same.py's comparison (nvcc + the cuobjdump Triton ships, no GPU): the same source gives the
same digests, a one-operation change a different one for that function only, whatever the file's path."""

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sass_same
import sass_schedule

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or not sass_schedule.cuobjdump_path().exists(),
    reason="needs nvcc and Triton's cuobjdump",
)

# `scale` in an anonymous namespace: its mangled name carries hashes of the file's path and of the compiling
# process, which differ between the copies compiled here as between the working tree's and a revision's.
SOURCE = """
namespace { __global__ void scale(float* x, float a) { x[threadIdx.x] *= a; } }
__global__ void shift(float* x, float a) { x[threadIdx.x] OP a; }
"""


def digests(tmp_path, op, side):
    """The file k.cu in folder `side` (as the working tree's and the revision's copies differ by folder)."""
    src = tmp_path / side / "k.cu"
    src.parent.mkdir(exist_ok=True)
    src.write_text(SOURCE.replace("OP", op))
    return sass_same.functions(src, "sm_90a", [])


def test_one_changed_operation_changes_only_its_functions_digest(tmp_path):
    add, again, sub = digests(tmp_path, "+=", "a"), digests(tmp_path, "+=", "b"), digests(tmp_path, "-=", "c")
    assert len(add) == 2 and add == again
    (scale,) = [n for n in add if "scale" in n]
    (shift,) = [n for n in add if "shift" in n]
    assert sub[scale] == add[scale]
    assert sub[shift] != add[shift]
