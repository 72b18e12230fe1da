"""Issue 20's shape limits on k26/: no function over 80 lines outside the kernels' front doors
(k26/ops/*_cuda.py: a launch passes every pointer and size by name), and the decoder class under 150."""

import ast
from pathlib import Path

K26 = Path(__file__).resolve().parent.parent / "k26"
MAX_FUNCTION, MAX_DECODER = 80, 150


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method of `source` longer than `limit` lines."""
    return [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit
    ]


def test_no_function_in_k26_is_over_80_lines():
    found = {
        f"{p.relative_to(K26.parent)}:{name}": n
        for p in sorted(K26.rglob("*.py"))
        if not (p.parent.name == "ops" and p.stem.endswith("_cuda"))
        for name, n in long_functions(p.read_text(), MAX_FUNCTION)
    }
    assert not found, found


def test_decoder_is_under_150_lines():
    tree = ast.parse((K26 / "decode.py").read_text())
    decoder = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Decoder")
    assert decoder.end_lineno - decoder.lineno + 1 < MAX_DECODER


def test_the_length_check_sees_a_long_method():
    body = "\n".join(f"        x{i} = {i}" for i in range(81))
    src = f"class A:\n    def short(self):\n        pass\n\n    def long(self):\n{body}\n"
    assert long_functions(src, MAX_FUNCTION) == [("long", 82)]


def test_every_source_file_has_its_row_in_docs_structure():
    """docs/structure.md names every module, script and kernel source (one line per module): a file added
    without its row is a layout nobody can find."""
    root = K26.parent
    doc = (root / "docs" / "structure.md").read_text()
    files = [
        p.relative_to(root).as_posix()
        for top in ("k26", "profiling", "scripts")
        for p in sorted((root / top).rglob("*"))
        if p.suffix in (".py", ".sh", ".cu", ".cuh") and "results" not in p.parts and "_build" not in p.parts
    ]
    missing = [f for f in files if f"`{f}`" not in doc and f"{f.rsplit('/', 1)[-1]}`" not in doc]
    assert files and not missing, missing
