"""The embedded default pair shipped in the package (k26/default/{target,drafter}): a tiny K2.6-architecture
target trained on the Python standard library and a DFlash drafter trained against it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_DIR = Path(__file__).parent / "default"  # the embedded pair: a tiny trained target + DFlash drafter


def default_model_dir() -> Path:
    """The embedded default target; a random tiny checkpoint (written once) if the package lacks one."""
    if (DEFAULT_DIR / "target" / "config.json").is_file():
        return DEFAULT_DIR / "target"
    from .tiny import write_tiny_checkpoint

    d = Path(os.environ.get("K26_CACHE", Path.home() / ".cache" / "k26")) / "tiny-random-k25"
    if not (d / "model.safetensors.index.json").is_file():
        print(f"[k26] no --model given: writing a random tiny K2.6-format checkpoint to {d}", file=sys.stderr)
        write_tiny_checkpoint(d)
    else:
        print(f"[k26] no --model given: using the random tiny checkpoint at {d}", file=sys.stderr)
    return d


def default_drafter_dir() -> Path | None:
    d = DEFAULT_DIR / "drafter"
    return d if (d / "config.json").is_file() else None
