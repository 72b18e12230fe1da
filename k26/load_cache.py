"""The optional load cache: each rank's already-sliced tensors in one safetensors file, so a later start
reads exactly its own bytes in one sequential pass.

An entry lives in `cache_dir/<checkpoint>-tp<rank>of<size>-<dtype>/` (weights.safetensors + meta.json) and
is used only if meta.json matches the checkpoint now on disk: its index and config digests, every shard's
stamp (size, mtime, ctime, inode: an in-place edit that puts size and mtime back still changes ctime), the
k26 version and a digest of the code that shapes the parameters, the TP shard and the dtype. Anything else
(another checkpoint, another k26, a changed shard, a truncated cache file) is said in one line and the
checkpoint is loaded fresh and the entry rewritten. The entry holds the checkpoint layout (the int4 repack
for the CUDA kernel runs after either path), so it stays valid across kernel layouts.
A cache_dir that cannot be one (a file, under a file, in a read-only directory) is refused before the load
(k26/cache_dir.py); a write that fails later (a full disk) leaves no partial entry and only warns.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from .safetensors_file import DTYPES, file_stamp, read_header, tensor_spans
from .shard_reader import Piece, ReadStats, fill_alone, io_read_bytes, staged_read
from .stager import Stager

FORMAT = 3  # 2: shard stamps with ctime and inode; 3: keyed by the path in the checkpoint, not the file name
_CODE = (
    "loader.py",
    "checkpoint_index.py",
    "safetensors_file.py",
    "shard_reader.py",
    "stager.py",
    "load_cache.py",
    "config.py",
    "config_quant.py",
    "config_rope.py",
    "model/*.py",
    "ops/int4.py",
)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_digest() -> str:
    """The k26 sources that decide parameter names, shapes and contents."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for pattern in _CODE:
        for f in sorted(root.glob(pattern)):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def fingerprint(path: Path, files: list[Path], rank: int, size: int, dtype: torch.dtype) -> dict:
    from . import __version__

    def file_digest(name: str) -> str:
        f = path / name
        return _digest(f.read_bytes()) if f.is_file() else "-"

    shards = {}
    for f in sorted(files, key=str):
        # (by the path in the checkpoint: part0/model.safetensors and part1/model.safetensors share a name,
        # and one's stamp overwrote the other's, so an edit of the first served stale weights)
        shards[os.path.relpath(f, path)] = list(file_stamp(f))
    return {
        "format": FORMAT,
        "k26": __version__,
        "code": code_digest(),
        "checkpoint": str(path.resolve()),
        "index": file_digest("model.safetensors.index.json"),
        "config": file_digest("config.json"),
        "shards": shards,
        "tp": [rank, size],
        "dtype": str(dtype),
    }


_ST = {v: k for k, v in DTYPES.items()}


def write_safetensors(f: Path, named: list[tuple[str, torch.Tensor]]) -> int:
    """A safetensors file streamed tensor by tensor (one host copy at a time, not the whole set), fsync'd."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for n, t in named:
        nb = t.numel() * t.element_size()
        header[n] = {"dtype": _ST[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + nb]}
        off += nb
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(f, "wb") as w:
        w.write(len(h).to_bytes(8, "little") + h)
        for _, t in named:
            w.write(memoryview(t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()))
        w.flush()
        os.fsync(w.fileno())
    return 8 + len(h) + off


DTYPES_BY_TORCH = {t: name for name, t in DTYPES.items()}


class LoadCache:
    """One rank's entry: `usable()` says (once, in one line) why not if it is not; `read(model)` fills the
    model from it; `write(model)` stores the model's parameters atomically."""

    def __init__(
        self, cache_dir: str | Path, path: Path, files: list[Path], rank: int, size: int, dtype: torch.dtype
    ):
        where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]  # same-named checkpoints differ
        name = f"{path.resolve().name}-{where}-tp{rank}of{size}-{str(dtype).removeprefix('torch.')}"
        self.dir = Path(cache_dir) / name
        self.weights, self.meta = self.dir / "weights.safetensors", self.dir / "meta.json"
        self.want = fingerprint(path, files, rank, size, dtype)

    def stale_reason(self) -> str | None:
        """Why the entry cannot be used, or None if it can."""
        if not self.meta.is_file() or not self.weights.is_file():
            return "no entry yet"
        try:
            have = json.loads(self.meta.read_text())
        except (OSError, json.JSONDecodeError) as e:
            return f"meta.json unreadable ({e})"
        diff = [k for k in self.want if have.get(k) != self.want[k]]
        if diff:
            return "made from a different " + ", ".join(diff)
        if self.weights.stat().st_size != have.get("weights_size"):
            return "weights.safetensors has the wrong size (an interrupted write?)"
        return None

    def usable(self, model: torch.nn.Module) -> bool:
        try:
            reason = self.stale_reason()
            if reason is None:
                reason = self._mismatch(model)
        except Exception as e:  # noqa: BLE001 - a vanished file, any bad header: never an error, a fresh load
            reason = f"unreadable ({e})"
        if reason is not None and reason != "no entry yet":
            print(f"load cache {self.dir}: {reason}; loading the checkpoint", file=sys.stderr, flush=True)
        return reason is None

    def _mismatch(self, model: torch.nn.Module) -> str | None:
        """Why the entry's tensors (read and checked as any safetensors file: `read_header`) are not the
        model's parameters, name for name, shape and dtype, or None."""
        params = {n: (DTYPES_BY_TORCH.get(p.dtype), tuple(p.shape)) for n, p in model.named_parameters()}
        header = read_header(self.weights)
        if {k: (dtype, shape) for k, (dtype, shape, _) in header.items()} != params:
            return "its tensors do not match the model's"
        return None

    def read(self, model: torch.nn.Module, device: torch.device, progress: bool = False) -> ReadStats:
        t0, io0 = time.perf_counter(), io_read_bytes()
        params = dict(model.named_parameters())
        spans = tensor_spans([self.weights])
        with open(self.weights, "rb") as h:
            header = json.loads(h.read(int.from_bytes(h.read(8), "little")))
        pieces = [
            Piece(
                k,
                None,
                self.weights,
                *spans[self.weights, k],
                DTYPES[header[k]["dtype"]],
                tuple(header[k]["shape"]),
            )
            for k in params
        ]
        stager = Stager(torch.device(device))
        fill = lambda bar: fill_alone(params, pieces, stager, bar)
        return staged_read(fill, pieces, stager, progress, t0, io0, from_cache=True)

    def write(self, model: torch.nn.Module) -> None:
        tmp, mtmp = self.dir / f"weights.{os.getpid()}.tmp", self.dir / f"meta.{os.getpid()}.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.meta.unlink(missing_ok=True)  # an entry is valid only once its meta says so
            # A stale entry and the leftovers of interrupted writes go first: a disk that holds one copy
            # of the rank's weights must be enough.
            self.weights.unlink(missing_ok=True)
            for old in self.dir.glob("*.tmp"):
                old.unlink(missing_ok=True)
            size = write_safetensors(tmp, list(model.named_parameters()))
            os.replace(tmp, self.weights)
            mtmp.write_text(json.dumps(self.want | {"weights_size": size}, indent=1))
            os.replace(mtmp, self.meta)
        except BaseException as e:  # also Ctrl-C mid-write: never leave a rank's worth of temp bytes behind
            with contextlib.suppress(OSError):  # (an entry directory that could not be made holds none)
                tmp.unlink(missing_ok=True)
                mtmp.unlink(missing_ok=True)
            if not isinstance(e, OSError):
                raise
            # full disk, read-only directory: the load itself succeeded
            msg = f"load cache {self.dir} not written ({e}); the next start reads the checkpoint again"
            warnings.warn(msg, stacklevel=2)


def compile_cache_file(cache_dir: str | Path, path: Path, device: torch.device) -> Path:
    """Where torch.compile's cache artifacts of this checkpoint's graphs live beside the load cache.
    torch keys every artifact by the graph it compiles, so a stale file only misses; the name still
    separates torch versions and GPUs, whose kernels differ."""
    from . import __version__

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = _digest(f"{__version__} {torch.__version__} {gpu} {path.resolve()}".encode())[:16]
    return Path(cache_dir) / f"compile-{path.resolve().name}-{key}.bin"


def load_compile_cache(f: Path) -> bool:
    """Pre-load torch.compile's caches (inductor FX graphs, autotuning) from `f`; False if there is none
    or it cannot be used (then compiling starts from scratch, as without the file)."""
    if not f.is_file():
        return False
    try:
        info = torch.compiler.load_cache_artifacts(f.read_bytes())  # None: unreadable (torch logs why)
    except Exception as e:  # noqa: BLE001  (another torch's artifacts: compile afresh, never fail the start)
        info, why = None, str(e)
    else:
        why = "unreadable"
    if info is None:
        print(f"compile cache {f}: not used ({why}); compiling afresh", file=sys.stderr, flush=True)
    return info is not None


def save_compile_cache(f: Path) -> None:
    """Store what this process compiled so far (torch's mega-cache), atomically; a failed write warns."""
    got = torch.compiler.save_cache_artifacts()
    if got is None:
        return
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(got[0])
        os.replace(tmp, f)
    except OSError as e:
        with contextlib.suppress(OSError):  # no directory to hold it (the failure itself), nothing to remove
            tmp.unlink(missing_ok=True)
        warnings.warn(f"compile cache {f} not written ({e})", stacklevel=2)
