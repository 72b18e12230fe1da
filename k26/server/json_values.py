"""Checks of single JSON values, shared by the request parsers (protocol.py and sampling_api.py): what
counts as an integer, a token-id list or a number field, and how a bad value is quoted in an error."""

from __future__ import annotations

import itertools
import json
from typing import Any

from .errors import APIError


def short(x: Any, limit: int = 80) -> str:
    """x as the client spelled it in JSON (true, "10", {"a": 1}: not Python's True, '10', {'a': 1}), cut to
    `limit` characters (an error message never echoes a megabyte back). Only a clipped copy is rendered:
    the first `limit` items or characters of each level, a few levels deep (a 64 MB value costs nothing)."""
    try:
        r = json.dumps(_clip(x, limit, 4), ensure_ascii=False)
    except (TypeError, ValueError):  # (not from JSON: a value the server derived)
        r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _clip(x: Any, n: int, depth: int) -> Any:
    """x's first n characters / items, `depth` levels down (deeper: "..."); enough to fill n characters."""
    if isinstance(x, str):
        return x[: n + 1]  # (one more: the cut still shows)
    if isinstance(x, (list, dict)) and depth == 0:
        return "..."
    if isinstance(x, list):
        return [_clip(v, n, depth - 1) for v in x[:n]]
    if isinstance(x, dict):
        return {str(k)[: n + 1]: _clip(v, n, depth - 1) for k, v in itertools.islice(x.items(), n)}
    return x


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
