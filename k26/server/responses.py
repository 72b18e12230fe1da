"""OpenAI response shapes: usage, one choice, a whole response or one streamed chunk around choices; a
streamed completion's text pieces (`TextPieces`)."""

from __future__ import annotations

import time

from ..sampling import stop_prefix_len
from ..tokenizer import TextStream


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """OpenAI's usage object; `cached`: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def choice(
    chat: bool,
    body: str | dict,
    finish: str | None,
    index: int = 0,
    delta: bool = False,
    logprobs: dict | None = None,
) -> dict:
    """One choice of a whole response or of a streamed chunk (`delta`), in the endpoint's OpenAI shape;
    `body`: a completion's text, or a chat message / delta object; `logprobs`: its tokens'
    (server/logprobs.py)."""
    key = "text" if not chat else "delta" if delta else "message"
    return {"index": index, key: body, "logprobs": logprobs, "finish_reason": finish}


def completion_body(
    rid: str,
    model: str,
    chat: bool,
    choices: list[dict],
    use: dict | None,
    delta: bool = False,
    created: int | None = None,
) -> dict:
    """A whole response (delta=False) or one streamed chunk around `choices` (see `choice`); a stream's chunks
    share their response's `created`."""
    if chat:
        obj = "chat.completion.chunk" if delta else "chat.completion"
    else:
        obj = "text_completion"
    when = int(time.time()) if created is None else created
    body = {"id": rid, "object": obj, "created": when, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


class TextPieces:
    """One choice of a streamed completion: its text as it grows, in whole UTF-8 characters; what may
    begin a stop string waits for the next tokens."""

    def __init__(self, tok, stops: tuple[str, ...]):
        self.ts, self.stops, self.sent = TextStream(tok), stops, 0

    def push(self, ids: list[int], finish: str | None, text: str | None) -> list[str]:
        """The text that is safe to send now (`sent`: where it ends)."""
        self.ts.push(ids)
        text = text if text is not None else self.ts.text  # a finished row's event carries its text
        end = len(text) if finish is not None else len(text) - stop_prefix_len(text, self.stops)
        piece, self.sent = text[self.sent : end], max(self.sent, end)
        return [piece] if piece else []

    def finish_reason(self, reason: str) -> str:
        return reason
