"""Reading a config.json (checkpoint or drafter) field by field: the file itself with a clear error for each
way it is absent or malformed, and typed access that names the offending field (`Fields`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json field k26 does not understand or cannot honour."""


def read_config_json(path: str | Path, what: str) -> dict[str, Any]:
    """The config.json of a checkpoint / drafter directory, with a clear error for each way it is absent."""
    path = Path(path)
    cfg_file = path / "config.json"
    if path.is_file():  # e.g. .../config.json itself
        raise ConfigError(
            f"{what} path {str(path)!r} is a file; pass the directory that holds it: {str(path.parent)!r}"
        )
    if not path.is_dir():
        raise ConfigError(f"{what} directory {str(path)!r} does not exist")
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file} is missing: a {what} directory needs config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except (ValueError, RecursionError) as e:  # (invalid JSON, not UTF-8)
        raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from e
    except OSError as e:
        raise ConfigError(f"{cfg_file} cannot be read: {e.strerror or e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_file} must hold a JSON object, not a {type(raw).__name__}")
    return raw


class Fields:
    """Typed access to one JSON object, naming the offending field on every error."""

    def __init__(self, d: dict[str, Any], prefix: str):
        self.d, self.prefix = d, prefix

    def get(self, key: str, default: Any = None) -> Any:
        return self.d.get(key, default)

    def _need(self, key: str, default: Any) -> Any:
        if key not in self.d or self.d[key] is None:
            if default is None:
                raise ConfigError(f"{self.prefix}{key} is missing from config.json")
            return default
        return self.d[key]

    def int(self, key: str, *, minimum: int = 1, default: int | None = None) -> int:
        v = self._need(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{self.prefix}{key}={v!r}: expected an integer >= {minimum}")
        return v

    def float(self, key: str, *, default: float | None = None) -> float:
        v = self._need(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ConfigError(f"{self.prefix}{key}={v!r}: expected a positive finite number")
        return float(v)

    def nonnegative(self, key: str, *, default: float) -> float:
        v = self._need(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ConfigError(f"{self.prefix}{key}={v!r}: expected a finite number >= 0")
        return float(v)

    def bool(self, key: str, *, default: bool | None = None) -> bool:
        v = self._need(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.prefix}{key}={v!r}: expected true or false")
        return v


def expect(f: Fields, key: str, value: Any) -> None:
    if key in f.d and f.d[key] is not None and f.d[key] != value:
        raise ConfigError(f"{f.prefix}{key}={f.d[key]!r} is not supported; k26 implements {value!r}")
