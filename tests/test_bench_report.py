"""The bench report's table, from given rows (no model run)."""

import argparse
from pathlib import Path

import torch

from k26.bench import _report


def test_bench_table_never_rounds_a_slow_rate_to_zero():
    a = argparse.Namespace(batch=1, max_tokens=3, budget=4, drafter=None, compile=False)
    rows = [("AR eager", 0.412, 1.0, None, "—"), ("DDTree eager (auto)", 12.34, 2.0, None, "{3: 1}")]
    rows += [("AR graphs", 1234.6, 1.0, 5e-6, "—")]
    out = _report(a, Path("m"), torch.device("cpu"), rows, [], None, command="python -m k26 bench")
    cells = [line.split(" | ")[1] for line in out.splitlines() if line.startswith("| ") and "eager" in line]
    cells += [line.split(" | ")[1] for line in out.splitlines() if line.startswith("| AR graphs")]
    assert cells == ["0.412", "12.3", "1235"]
