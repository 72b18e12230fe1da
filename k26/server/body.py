"""A request's JSON body, read without stalling the other clients: a size cap checked before the bytes are
held (413), the parse in a worker thread (a 30 MB body took ~0.3 s of the event loop), and every string
checked to be Unicode text, naming the first that is not.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request

from .errors import APIError

# Far above any request the engine can serve (a 256K-token prompt is ~1 MB of text or ~2 MB of ids; 64
# prompts a request at most), low enough that one client cannot hold the server's memory or its parser.
MAX_BODY_BYTES = 64 << 20


async def read_json(request: Request, limit: int = MAX_BODY_BYTES):
    """The body as JSON; APIError 413 above `limit` bytes (by Content-Length before reading, or as the
    chunks arrive), 400 for what is not JSON or not text."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return await asyncio.to_thread(parse_json, b"".join(chunks))


def parse_json(raw: bytes):
    """`raw` as JSON whose every string (and key) is Unicode text; APIError 400 otherwise."""
    try:
        body = json.loads(raw)
    # (JSONDecodeError, UnicodeDecodeError, a 4,300+ digit integer: ValueErrors; deep nesting recurses)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if (where := unpaired_surrogate(body)) is not None:  # valid JSON ("\ud800"), but not text
        raise APIError(400, f"{where or 'the body'}: a string holds an unpaired UTF-16 surrogate", where)
    return body


def unpaired_surrogate(x) -> str | None:
    """The parameter path ("messages[0].content") of the first string (or key) that is not valid Unicode
    text, else None. Iterative: a body nested deeper than Python's recursion limit still parses on
    Python >= 3.13, whose json module has its own limit."""
    stack = [(x, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path
            continue
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        pending = []
        for k, item in items:
            at = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k)
            if isinstance(k, str):
                pending.append((k, at))
            pending.append((item, at))
        stack.extend(reversed(pending))  # document order: the first bad string is the one named
    return None


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the request body is {size:,} bytes or more, above this server's limit of {limit:,}", None
    )
