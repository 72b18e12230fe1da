"""Checks of single JSON values, shared by the request parsers (protocol.py and sampling_api.py): what
counts as an integer, a token-id list or a number field, and how a bad value is quoted in an error."""

from __future__ import annotations

import json
from typing import Any

from .errors import APIError


def short(x: Any, limit: int = 80) -> str:
    """x as the client spelled it in JSON (true, "10", {"a": 1}: not Python's True, '10', {'a': 1}), cut to
    `limit` characters (an error message never echoes a megabyte back)."""
    try:
        r = json.dumps(x, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # (not from JSON: a value the server derived)
        r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def is_int(x: Any) -> bool:
    """A JSON integer (true / false arrive as bool, a subclass of int, and are not one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def id_list(x: Any, vocab: int) -> bool:
    """A list of token ids of this vocabulary."""
    return isinstance(x, list) and all(is_int(t) and 0 <= t < vocab for t in x)


def number(body: dict, name: str, default: float) -> float:
    x = body.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise APIError(400, f"{name}={short(x)}: expected a number", name)
    try:
        return float(x)
    except OverflowError:  # an integer beyond float range (JSON allows any)
        raise APIError(400, f"{name}={short(x)}: out of range", name) from None
