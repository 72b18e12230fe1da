"""A checkpoint directory's tensor index: every shard's safetensors header read (no memory map), names keyed
as the loader matches them (`language_model.` stripped, vision tensors skipped), each tensor's file, dtype,
shape, byte span and the file's stamp; `CheckpointError` (every problem found, reported together).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .safetensors_file import file_stamp, read_header

PREFIX = "language_model."  # K2.5 / K2.6 nest the LM inside a multimodal checkpoint
_SKIP = re.compile(r"^(vision_tower|mm_projector|multi_modal_projector)\.|\.rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes; `problems` lists every mismatch."""

    def __init__(self, path: Path, problems: list[str]):
        self.path, self.problems = path, problems
        if len(problems) == 1:  # one cause: one line
            super().__init__(f"checkpoint {path} cannot be loaded: {problems[0]}")
            return
        shown = "\n  ".join(problems[:40])
        more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
        super().__init__(f"checkpoint {path} cannot be loaded ({len(problems)} problems):\n  {shown}{more}")

    def __reduce__(self):  # (a TP rank's error travels to rank 0 pickled, and is raised there as itself)
        return type(self), (self.path, self.problems)


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    key: str  # the name inside the file (with any prefix)
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: BF16, F32, I32, ...
    span: tuple[int, int] | None = None  # absolute [start, end) of its bytes in the file
    stamp: tuple[int, int] | None = None  # the file's (size, mtime_ns) when the header was read


def read_index(path: Path) -> dict[str, TensorInfo]:
    """Headers of every shard, keyed by HF name with `language_model.` stripped and vision skipped."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # (invalid JSON or UTF-8, no map)
            raise CheckpointError(path, [f"{index_file.name} is not a valid index ({e})"]) from e
        except OSError as e:
            raise CheckpointError(path, [f"{index_file.name} cannot be read ({e.strerror or e})"]) from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            why = "weight_map must map tensor names to shard names"
            raise CheckpointError(path, [f"{index_file.name}: {why}"])
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(path, ["no *.safetensors files and no model.safetensors.index.json"])
    problems: list[str] = []
    infos: dict[str, TensorInfo] = {}
    unreadable: set[str] = set()  # its tensors are reported once, in the shard's own line
    for fname in files:
        f = path / fname
        if not f.is_file():
            problems.append(f"shard {fname} named by the index is missing")
            continue
        try:
            stamp = file_stamp(f)
            for key, (dtype, shape, span) in read_header(f).items():
                name = key.removeprefix(PREFIX)
                if _SKIP.search(name):
                    continue
                if name in infos:
                    problems.append(f"tensor {key} appears twice ({infos[name].file.name} and {fname})")
                infos[name] = TensorInfo(f, key, shape, dtype, span, stamp)
        except OSError as e:  # (permissions, I/O: the file may be fine)
            unreadable.add(fname)
            problems.append(f"shard {fname} cannot be read: {e.strerror or e}")
        except Exception as e:  # noqa: BLE001  (a bad header, or anything else: any failure is reported)
            unreadable.add(fname)
            listed = sum(v == fname for v in weight_map.values()) if weight_map is not None else 0
            held = (
                f" (it holds {listed} tensors of the index; truncated or still downloading?)"
                if listed
                else ""
            )
            problems.append(f"shard {fname} is corrupt or not a safetensors file{held}: {e}")
    if weight_map is not None:
        for key, fname in weight_map.items():
            name = key.removeprefix(PREFIX)
            if fname in unreadable:
                continue
            if not _SKIP.search(name) and name not in infos and (path / fname).is_file():
                problems.append(f"tensor {key} is listed in the index under {fname} but is not in that file")
    if problems:
        raise CheckpointError(path, problems)
    return infos
