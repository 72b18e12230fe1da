"""The safetensors file format as the loader reads it: dtypes, headers parsed and checked with plain reads
(no memory map), tensors' byte spans, one small tensor's exact bytes, and a shard's stamp (size, mtime,
ctime, inode). `shard_reader` plans and runs the large reads on top of this."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from .stager import ShardChangedError, Stamp, open_random, stamp

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_small(f: Path, span: tuple[int, int], dtype: str) -> torch.Tensor:
    """One small tensor's exact bytes (e.g. an int4 `weight_shape`), without mapping or readahead."""
    fd = open_random(f)
    try:
        data = os.pread(fd, span[1] - span[0], span[0])
    finally:
        os.close(fd)
    if len(data) != span[1] - span[0]:
        raise ShardChangedError(f"shard {f.name} is shorter than its header says: it changed on disk")
    return torch.frombuffer(bytearray(data), dtype=DTYPES[dtype])


def file_stamp(f: Path) -> Stamp:
    return stamp(f.stat())


_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_ITEMSIZE |= {"I16": 2, "U16": 2, "F16": 2, "BF16": 2}
_ITEMSIZE |= {"I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


MAX_HEADER = 100_000_000  # bytes: safetensors' own cap (a larger "header" is not a safetensors file)


def read_header(f: Path) -> dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]:
    """A safetensors file's tensors: key -> (dtype, shape, absolute [start, end) of its bytes), read with
    plain reads and checked as the format requires (safetensors' own checks): the header fits the file,
    each entry is well formed (integer shape and offsets matching shape x dtype), and the tensors tile the
    data exactly, no overlap, hole or trailing byte (an entry given another's offsets would otherwise load
    that tensor's bytes, silently). ValueError otherwise. No memory map: a mapped header faults in the
    disk's readahead window around it (measured 8 MB per shard, 0.36 GB for a 43-shard checkpoint, all of
    it read again when the tensors are)."""
    fd = open_random(f)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n > MAX_HEADER:
            raise ValueError(
                f"its header claims {n} bytes, above safetensors' {MAX_HEADER}: not a safetensors file"
            )
        if not 2 <= n <= size - 8:
            raise ValueError(f"its header ({n} bytes) does not fit the file ({size} bytes; truncated?)")
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    header = _parse(raw)
    out, spans = {}, []
    for key, v in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = v["dtype"], tuple(v["shape"]), v["data_offsets"]
            ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (*shape, a, b))
            ok = ints and min(shape, default=0) >= 0 and 0 <= a <= b
            # Python integers: torch.Size's int64 count wraps (a [2^32, 2^32] tensor counted 0 bytes)
            ok = ok and b - a == math.prod(shape) * _ITEMSIZE[dtype]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tensor {key} has a malformed header entry ({e!r})") from e
        if not ok:
            raise ValueError(f"tensor {key}: data_offsets {[a, b]} do not hold {dtype} {list(shape)}")
        if 8 + n + b > size:
            raise ValueError(
                f"tensor {key} ends at byte {8 + n + b}, past the end of the file ({size}; truncated?)"
            )
        out[key] = (dtype, shape, (8 + n + a, 8 + n + b))
        spans.append((a, b, key))
    end = 0
    for a, b, key in sorted(spans):
        if a != end:
            what = (
                "overlaps the tensor before it" if a < end else f"leaves a hole of {a - end} bytes before it"
            )
            raise ValueError(
                f"tensor {key}: data_offsets {[a, b]} {what} (each tensor's bytes follow the last)"
            )
        end = b
    if 8 + n + end != size:
        raise ValueError(f"the tensors end at byte {8 + n + end} but the file has {size} (trailing bytes)")
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}


class _Object(dict):
    """A JSON object of the header with the keys it held twice (json.loads keeps the last of each)."""

    twice: frozenset = frozenset()


def _object(pairs: list[tuple[str, object]]) -> _Object:
    out = _Object(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        out.twice = frozenset(k for k, _ in pairs if k in seen or seen.add(k))
    return out


def _parse(raw: bytes) -> dict:
    """The header's JSON object as safetensors parses it: UTF-8 (json.loads would also take UTF-16 or 32),
    no NaN / Infinity, and `__metadata__` absent, null or an object of strings. A header safetensors refuses
    must be refused here too: the drafter's tensors are read through safetensors' own loader, which raised
    its raw error only then, after the target's load."""
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_object)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # (JSONDecodeError is a ValueError)
        raise ValueError(f"its header is not UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")  # noqa: TRY004  (a bad file, as the others)
    # A tensor's entry with one of its fields twice: safetensors' parser refuses it (a struct there); a tensor
    # name, a metadata key or a key it ignores twice it takes (maps there, the last kept), as json.loads does.
    for name, entry in header.items():
        if name != "__metadata__" and isinstance(entry, _Object) and entry.twice & ENTRY_FIELDS:
            field = min(entry.twice & ENTRY_FIELDS)
            raise ValueError(f"tensor {name}: its header entry has the field {field!r} twice")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError(f"its __metadata__ must map names to strings, got {str(meta)[:80]}")
    return header


def tensor_spans(files: list[Path]) -> dict[tuple[Path, str], tuple[int, int]]:
    """(file, key) -> absolute [start, end) of the tensor's bytes, from each shard's header."""
    return {(f, key): span for f in files for key, (_, _, span) in read_header(f).items()}
