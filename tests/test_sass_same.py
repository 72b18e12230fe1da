"""scripts/sass_same.py's comparison (nvcc + the cuobjdump Triton ships, no GPU): the same source gives the
same digests, a one-operation change a different one for that function only."""

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

SOURCE = """
__global__ void scale(float* x, float a) { x[threadIdx.x] *= a; }
__global__ void shift(float* x, float a) { x[threadIdx.x] OP a; }
"""


def digests(tmp_path, op):
    src = tmp_path / f"k_{'add' if op == '+=' else 'sub'}.cu"
    src.write_text(SOURCE.replace("OP", op))
    return sass_same.functions(src, "sm_90a", [], tmp_path)


def test_one_changed_operation_changes_only_its_functions_digest(tmp_path):
    add, again, sub = digests(tmp_path, "+="), digests(tmp_path, "+="), digests(tmp_path, "-=")
    assert len(add) == 2 and add == again
    (scale,) = [n for n in add if "scale" in n]
    (shift,) = [n for n in add if "shift" in n]
    assert sub[scale] == add[scale]
    assert sub[shift] != add[shift]
