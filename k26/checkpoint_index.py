"""A checkpoint directory's tensor index: every shard's safetensors header read (no memory map), names keyed
as the loader matches them (`language_model.` stripped, vision tensors skipped), each tensor's file, dtype,
shape, byte span and the file's stamp; `CheckpointError` (every problem found, reported together).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .safetensors_file import file_stamp, read_header
from .stager import Stamp

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


class Tally:
    """Tensors of one problem (missing, unexpected): the first SHOWN named, every one counted by kind (its
    name with the layer and expert numbers as *), so a config that promises far more than the checkpoint
    holds (or the reverse) gives a bounded report, not a line per tensor."""

    SHOWN = 10

    def __init__(self, what: str):
        self.what, self.named, self.kinds = what, [], {}

    def add(self, name: str, note: str = "") -> None:
        if len(self.named) < self.SHOWN:
            self.named.append(f"{self.what} {name}{note}")
        kind = _NUMBER.sub("*", name)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def lines(self) -> list[str]:
        n = sum(self.kinds.values())
        if n <= self.SHOWN:
            return self.named
        top = sorted(self.kinds.items(), key=lambda kv: -kv[1])
        kinds = ", ".join(f"{c} x {k}" for k, c in top[:8]) + (", ..." if len(top) > 8 else "")
        return [*self.named, f"... {n} {self.what}s in all, by kind: {kinds}"]


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")


def check_layers(
    infos: dict[str, TensorInfo], path: Path, layers: int, experts: int, where: str = "model.layers"
) -> None:
    """The layers and routed experts the config promises must be the ones the checkpoint holds tensors for,
    checked before the model is built: an absurd count (200000 layers) was minutes of building and of
    listing every missing tensor. `experts`: the routed experts of each MoE layer (0: the model has none);
    `where`: the layers' name prefix (a drafter's: "layers")."""
    held, held_experts = set(), set()
    k = where.count(".") + 1  # the layer number's place in a name
    for name in infos:
        parts = name.split(".", k + 4)
        if parts[:k] == where.split(".") and len(parts) > k and parts[k].isdecimal():
            held.add(int(parts[k]))
            if parts[k + 1 : k + 3] == ["mlp", "experts"] and len(parts) > k + 3 and parts[k + 3].isdecimal():
                held_experts.add(int(parts[k + 3]))
    problems = []
    if len(held) != layers or held != set(range(layers)):  # (len first: the count may be absurd)
        problems.append(
            f"the config says {layers} layers (num_hidden_layers), the checkpoint has tensors for "
            f"{len(held)}{_which(held, layers, 'layers')}"
        )
    # (none held while the config promises some: a count like 10**6 made the load plan loop that often first)
    if (held_experts or experts) and (len(held_experts) != experts or held_experts != set(range(experts))):
        which = _which(held_experts, experts, "experts")
        problems.append(
            f"the config says {experts} routed experts (n_routed_experts), the checkpoint has tensors for "
            f"{len(held_experts)}{which}"
            if experts
            else f"the config has no MoE layer, yet the checkpoint has tensors for {len(held_experts)} "
            f"routed experts{which}"
        )
    if problems:
        raise CheckpointError(path, problems)


def _which(held: set[int], want: int, noun: str) -> str:
    """Which ones: a range when they are 0..n-1, else the first few absent below `want` or beyond it."""
    if held == set(range(len(held))):
        return f" ({noun} 0 to {len(held) - 1})" if held else ""
    absent = sorted(set(range(min(want, max(held) + 1))) - held)[:10]
    beyond = sorted(n for n in held if n >= want)[:10]
    said = ([f"none for {noun} {absent}"] if absent else []) + (
        [f"also for {noun} {beyond}"] if beyond else []
    )
    return f" ({'; '.join(said)})"


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    key: str  # the name inside the file (with any prefix)
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: BF16, F32, I32, ...
    span: tuple[int, int] | None = None  # absolute [start, end) of its bytes in the file
    stamp: Stamp | None = None  # the file's `stager.stamp` when the header was read


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
        if not weight_map:  # (else: 'the config says N layers, the checkpoint has tensors for 0')
            raise CheckpointError(path, [f"{index_file.name}: weight_map is empty (it names no shard)"])
        # One file under two spellings ('x.safetensors', './x.safetensors') is one shard, read once (else
        # every tensor of it 'appeared twice'), as transformers takes it
        weight_map = {k: os.path.normpath(v) for k, v in weight_map.items()}
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
        try:
            present = f.is_file()
        except OSError as e:  # (a name the file system refuses, say too long: is_file raises, not False)
            unreadable.add(fname)
            problems.append(f"shard {fname} cannot be read: {e.strerror or e}")
            continue
        if not present:
            why = (
                "named by the index is missing"
                if weight_map is not None
                else "is no regular file (a broken link?)"
            )
            problems.append(f"shard {fname} {why}")
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
