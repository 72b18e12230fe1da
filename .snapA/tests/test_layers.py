"""The k26 import graph (scripts/import_graph.py): no cycle, no import from a higher layer of
docs/structure.md, every module in a layer; and the checker itself catches each of those."""

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py"
_spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_k26_imports_only_downward_and_without_cycles():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert "k26.engine -> " in run.stdout and "no cycle, no upward import" in run.stdout


def test_checker_refuses_cycles_upward_imports_and_unplaced_modules():
    layers = [["ops"], ["model"], ["engine"]]
    graph = {
        "k26.ops.a": {"k26.model.m"},  # upward
        "k26.model.m": {"k26.model.n"},
        "k26.model.n": {"k26.model.m"},  # cycle m -> n -> m
        "k26.engine": {"k26.ops.a"},
        "k26.stray": set(),  # no layer
    }
    found = import_graph.problems(graph, layers)
    assert any(p.startswith("upward import: k26.ops.a (layer 0) -> k26.model.m") for p in found)
    assert "import cycle: k26.model.m -> k26.model.n -> k26.model.m" in found
    assert "k26.stray: no layer in docs/structure.md names it" in found
    assert len(found) == 3
    assert import_graph.problems({"k26.engine": {"k26.ops.a"}, "k26.ops.a": set()}, layers) == []
