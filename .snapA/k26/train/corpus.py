"""The training corpus: Python standard-library sources, present on every machine.

The module list is pinned (modules that exist in 3.11, 3.12 and 3.13) and sorted, so the corpus is
deterministic per Python version; a fixed set of modules is held out for evaluation.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

MODULES = [
    "argparse",
    "ast",
    "base64",
    "bdb",
    "bisect",
    "bz2",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "codeop",
    "colorsys",
    "compileall",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "dis",
    "doctest",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "imaplib",
    "inspect",
    "ipaddress",
    "keyword",
    "linecache",
    "locale",
    "lzma",
    "mailbox",
    "mimetypes",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "posixpath",
    "pprint",
    "profile",
    "pstats",
    "py_compile",
    "pyclbr",
    "pydoc",
    "queue",
    "quopri",
    "random",
    "reprlib",
    "rlcompleter",
    "runpy",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "site",
    "smtplib",
    "socket",
    "socketserver",
    "ssl",
    "stat",
    "statistics",
    "string",
    "stringprep",
    "struct",
    "subprocess",
    "symtable",
    "sysconfig",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "token",
    "tokenize",
    "trace",
    "traceback",
    "tracemalloc",
    "types",
    "typing",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "webbrowser",
    "zipapp",
    "zipfile",
    "zipimport",
]
# Packages add ~4 MB of code (tests excluded); only packages present in 3.11 through 3.13.
PACKAGES = [
    "asyncio",
    "collections",
    "concurrent",
    "email",
    "html",
    "http",
    "importlib",
    "json",
    "logging",
    "multiprocessing",
    "re",
    "tomllib",
    "unittest",
    "urllib",
    "wsgiref",
    "xml",
    "xmlrpc",
    "zoneinfo",
]
HELD_OUT = ("bisect", "fractions", "graphlib", "heapq", "netrc", "sched", "shlex", "textwrap")


def stdlib_dir() -> Path:
    return Path(os.path.dirname(os.__file__))


def files(split: str) -> list[Path]:
    """'train' or 'eval' source files, sorted; modules missing on this Python are skipped."""
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r}: expected 'train' or 'eval'")
    names = [m for m in MODULES if (m in HELD_OUT) == (split == "eval")]
    out = [p for p in (stdlib_dir() / f"{m}.py" for m in names) if p.is_file()]
    if split == "train":
        out += [p for pkg in PACKAGES for p in (stdlib_dir() / pkg).rglob("*.py") if not _is_test(p)]
    return sorted(out)


def _is_test(p: Path) -> bool:
    return any(part in ("test", "tests") or part.startswith("test_") for part in p.parts[-3:])


def text(split: str) -> str:
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files(split))


def windows(ids: list[int], n: int, length: int, gen: torch.Generator, room: int = 0) -> list[list[int]]:
    """`n` prompts of `length` token ids at random offsets (from `gen`), each followed by at least `room`
    more ids of the text: held-out prompts for the benches."""
    return [
        ids[s : s + length] for s in torch.randint(0, len(ids) - length - room, (n,), generator=gen).tolist()
    ]
