"""A request's JSON body: a size cap checked before the bytes are held (413), the parse in a worker thread,
and every string checked to be Unicode text, naming the first that is not.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

from fastapi import Request
from starlette.requests import ClientDisconnect

from .errors import SHUTTING_DOWN, APIError

# A 256K-token prompt is ~1 MB of text or ~2 MB of ids; many such prompts in one request (up to 64 are
# allowed) may exceed it, and go as several requests. Parsing holds the GIL: a body near the cap pauses the
# other streams for about a second (tokenizing does not: tiktoken releases it). `serve --max-request-mb`.
MAX_BODY_BYTES = 64 << 20
# A body whose next bytes take longer than this is dropped (408): a client that declares more than it sends
# would otherwise hold its connection and the bytes so far for as long as it likes.
BODY_STALL_S = 30.0
# ... and one that trickles in (a byte every 29 s) is dropped once its upload has taken this long per 64 MB
# of the size cap (`serve --max-request-mb`): the default cap's 64 MB at 1 MB/s takes ~64 s.
BODY_DEADLINE_S = 300.0


async def read_json(request: Request, limit: int = MAX_BODY_BYTES, stopping=lambda: False):
    """The body as JSON; APIError 415 for a Content-Type other than JSON (none is taken as JSON), 413 above
    `limit` bytes (by Content-Length before reading, or as the chunks arrive), 408 for a body stalled for
    BODY_STALL_S or still uploading after BODY_DEADLINE_S per 64 MB of `limit`, 503 once `stopping()` (the
    server shuts down while the body uploads: an answer, not a cancelled handler), 400 for what is not JSON or
    not text, 499 for a client gone before the body ended."""
    check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size, stall = [], 0, BODY_STALL_S
    deadline = BODY_DEADLINE_S * max(1.0, limit / MAX_BODY_BYTES)
    parts, end = request.stream(), time.monotonic() + deadline
    try:
        while (chunk := await _next_part(parts, min(stall, end - time.monotonic()), stopping)) is not None:
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:  # the client left before its body came whole: its doing, not a 500 of ours
        raise APIError(499, "client closed the request") from None
    except TimeoutError:
        if time.monotonic() >= end:
            why = f"still uploading after {deadline:g} s ({size} bytes so far)"
        else:
            why = f"stalled: nothing for {stall:g} s after {size} bytes"
        raise APIError(408, f"the request body {why}") from None
    return await asyncio.to_thread(parse_json, b"".join(chunks))


async def _next_part(parts, stall: float, stopping) -> bytes | None:
    """The body's next chunk (None at its end), looking at `stopping` every second while it waits;
    TimeoutError after `stall` seconds without one."""

    async def take():
        try:
            return await anext(parts)
        except StopAsyncIteration:
            return None

    task, waited = asyncio.ensure_future(take()), 0.0
    try:
        while True:
            step = max(0.0, min(1.0, stall - waited))  # (0 past the deadline: one look, then 408)
            done, _ = await asyncio.wait({task}, timeout=step)
            if done:
                return task.result()
            if stopping():
                raise APIError(503, SHUTTING_DOWN, type="server_error", code="server_shutting_down")
            waited += step
            if waited >= stall:
                raise TimeoutError
    finally:
        task.cancel()


def check_content_type(value: str | None) -> None:
    """A body declared as something else than JSON is refused, not parsed as JSON anyway: a browser page may
    POST text/plain or a form to any address without asking (no CORS preflight), and would spend this
    server's compute when it runs without --api-key; `curl -d` without -H sends a form type too."""
    media = (value or "").split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(
            415,
            f"Content-Type {value[:100]!r}: the request body must be JSON (Content-Type: application/json)",
        )


def parse_json(raw: bytes):
    """`raw` as UTF-8 JSON whose every string (and key) is Unicode text; APIError 400 otherwise."""
    # UTF-8 only (RFC 8259): json.loads(bytes) also takes UTF-16 / -32, whose escapes the check below misses
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 text: {e}") from None
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    # (JSONDecodeError, a 4,300+ digit integer, NaN / Infinity / 1e400: ValueErrors; deep nesting recurses)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    # A lone surrogate can only come as a \uD800-\uDFFF escape (UTF-8 input cannot hold one): without such
    # an escape in the bytes, no walk (a 10M-id body took seconds and a gigabyte to walk).
    if _SURROGATE_ESCAPE.search(raw) and (where := unpaired_surrogate(body)) is not None:
        shown = where.encode("utf-8", "backslashreplace").decode()  # (the path itself may hold it)
        raise APIError(400, f"{shown or 'the body'}: a string holds an unpaired UTF-16 surrogate", shown)
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name: str):
    """json.loads takes NaN, Infinity and -Infinity, which JSON (RFC 8259) has not: a tool schema would pass
    them into the prompt as they came."""
    raise ValueError(f"{name} is not a JSON value (RFC 8259 has no NaN or Infinity)")


def _finite(text: str) -> float:
    """A JSON number with a fraction or an exponent, refused where a float cannot hold it (1e400 read as
    inf: rendered as Infinity into a tool schema, as the literal was)."""
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is beyond a double's range")
    return v


def unpaired_surrogate(x) -> str | None:
    """The parameter path ("messages[0].content") of the first string (or key), in document order, that is
    not valid Unicode text, else None. Iterative (any depth), holding one iterator per open container."""

    def bad(v) -> bool:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    def entries(v):
        return iter(v.items()) if isinstance(v, dict) else iter(enumerate(v))

    if isinstance(x, str):
        return "" if bad(x) else None
    if not isinstance(x, (dict, list)):
        return None
    # Each open container's iterator and the key it sits under; the path is spelled only once found (built
    # level by level it cost quadratic time in the depth)
    stack = [(entries(x), None)]
    while stack:
        for k, item in stack[-1][0]:
            if (isinstance(k, str) and bad(k)) or (isinstance(item, str) and bad(item)):
                return _path([key for _, key in stack[1:]] + [k])
            if isinstance(item, (dict, list)):
                stack.append((entries(item), k))
                break
        else:
            stack.pop()
    return None


def _path(keys: list) -> str:
    """The path "messages[0].content" from the keys ["messages", 0, "content"]."""
    out = ""
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else f".{k}" if out else k
    return out


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the request body is {size:,} bytes or more, above this server's limit of {limit:,}", None
    )
