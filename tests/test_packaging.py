"""A non-editable install (a wheel) carries what k26 reads at run time: the kernel sources the library is
built from on first use (every .cu and the headers they include) and the embedded pair's files."""

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "k26"


def package_data() -> list[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return cfg["tool"]["setuptools"]["package-data"]["k26"]


def shipped(rel: str) -> bool:
    return any(fnmatch.fnmatchcase(rel, pattern) for pattern in package_data())


def test_every_kernel_source_and_header_is_package_data():
    sources = sorted(p.relative_to(PKG).as_posix() for p in (PKG / "ops" / "csrc").iterdir() if p.is_file())
    assert any(s.endswith(".cuh") for s in sources) and any(s.endswith(".cu") for s in sources)
    assert [s for s in sources if not shipped(s)] == []


def test_the_embedded_pairs_files_are_package_data():
    files = sorted(p.relative_to(PKG).as_posix() for p in (PKG / "default").rglob("*") if p.is_file())
    assert files and [f for f in files if not shipped(f)] == []
