"""The k26 module import graph, from the module-level imports (an AST scan: nothing is imported), checked
against the layers in docs/structure.md: exits 1 on an import cycle, an import from a higher layer, or a
module no layer names. Imports inside functions (deferred on purpose) are not edges.

    python scripts/import_graph.py        # prints "module -> imported k26 modules", one line each
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "k26"
DOC = ROOT / "docs" / "structure.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements outside function and class bodies (module level, `if` / `try` blocks included)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the k26 modules it imports at module level (`from pkg import sub` counts as pkg.sub)."""
    modules = {module_name(p): p for p in sorted(package.rglob("*.py"))}
    graph = {}
    for name, path in modules.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in module_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bases, names = [a.name for a in node.names], []
            else:
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                bases, names = [base], [f"{base}.{a.name}" for a in node.names]
            deps |= {n for n in names if n in modules}  # a submodule imported by name
            if not names or any(n not in modules for n in names):  # names defined in the module itself
                deps |= {b for b in bases if b in modules}
        graph[name] = deps - {name}
    return graph


def doc_layers(doc: Path = DOC) -> list[list[str]]:
    """The layers, lowest first, from the line of docs/structure.md that starts with "Layers": groups
    separated by "←", each naming its modules (or packages) in backticks."""
    line = next(x for x in doc.read_text().splitlines() if x.startswith("Layers"))
    return [re.findall(r"`([\w.]+)`", part) for part in line.split("←")]


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The layer of the longest name that is the module or a package above it ("k26": the package itself)."""
    rel = module.removeprefix("k26.") if module != "k26" else "k26"
    best = None
    for i, names in enumerate(layers):
        for n in names:
            if (rel == n or rel.startswith(n + ".")) and (best is None or len(n) > len(best[1])):
                best = (i, n)
    return best[0] if best else None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def problems(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """What breaks the rules: modules without a layer, imports from a higher layer, a cycle."""
    out = []
    level = {m: layer_of(m, layers) for m in graph}
    out += [f"{m}: no layer in docs/structure.md names it" for m in sorted(graph) if level[m] is None]
    for m in sorted(graph):
        for d in sorted(graph[m]):
            if level[m] is not None and level.get(d) is not None and level[d] > level[m]:
                out.append(f"upward import: {m} (layer {level[m]}) -> {d} (layer {level[d]})")
    if cycle := find_cycle(graph):
        out.append("import cycle: " + " -> ".join(cycle))
    return out


def main() -> int:
    graph = import_graph()
    for m in sorted(graph):
        print(f"{m} -> {', '.join(sorted(graph[m])) or '-'}")
    bad = problems(graph, doc_layers())
    for p in bad:
        print(p, file=sys.stderr)
    print(
        f"{len(graph)} modules, {sum(map(len, graph.values()))} imports: "
        + ("FAIL" if bad else "no cycle, no upward import")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
