"""/v1/chat/completions in the Kimi chat format: request messages, tools, tool_choice and the thinking
switch checked and rendered (`chat.render`); each choice's output read back (`chat_parser.ChatParser`) as an
OpenAI assistant message — `reasoning_content` (K2.5 / K2.6 thinking, as vLLM's and SGLang's reasoning
parsers name it), `content`, `tool_calls` with finish_reason "tool_calls" — whole or as stream deltas.

Not served, refused by name: tool_choice "required" or a named function (forcing a call needs
constrained decoding). tool_choice "none" renders no tool declarations (the model then has none to call).
parallel_tool_calls = false keeps the first call of a turn.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any

from ..chat import (
    ChatFormat,
    Message,
    PromptTooLong,
    ToolCall,
    is_text_part,
    odd_keys,
    render,
    text_of,
)
from ..chat_parser import ChatParser, Piece
from ..chat_tools import odd_field
from ..sampling import stop_prefix_len
from ..tokenizer import Tokenizer
from .errors import APIError
from .json_values import short

MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule; also keeps "." and ":" out of Kimi call ids
MAX_DEPTH = 64  # nesting of a tool's JSON schema
ROLE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "reasoning_content"},
    "tool": {"role", "content", "tool_call_id", "name"},
}


@dataclass(frozen=True)
class ChatTurn:
    """How to read a chat request's output: the prompt opened `<think>` (the output starts in reasoning),
    and how many tool calls a turn may return (None: all)."""

    thinking: bool
    limit: int | None
    tools: bool = True  # tools were declared (tool_choice not "none"): the output's tool calls are read


def parse_chat(
    body: dict, tok: Tokenizer, fmt: ChatFormat, max_len: int | None = None
) -> tuple[list[int], ChatTurn]:
    """The prompt ids of a chat request and how to read its output; every bad item named. A conversation whose
    text alone cannot fit `max_len` tokens is refused before it is encoded, naming its largest part (tens of
    megabytes take seconds of a worker; completions' prompts get the same bound)."""
    kw, KW = body.get("chat_template_kwargs"), "chat_template_kwargs"
    if kw is not None and (not isinstance(kw, dict) or set(kw) - {"thinking", "preserve_thinking"}):
        raise APIError(400, f"{KW}: only 'thinking' and 'preserve_thinking' (booleans) are supported", KW)
    on, keep = (kw or {}).get("thinking"), (kw or {}).get("preserve_thinking")
    for name, v in (("thinking", on), ("preserve_thinking", keep)):
        if v is not None and not isinstance(v, bool):
            raise APIError(400, f"{KW}.{name}={short(v)}: expected true or false", KW)
    try:
        fmt = fmt.with_thinking(on, keep)
    except ValueError as e:
        raise APIError(400, f"{KW}: {e}", KW) from None
    tools = _tools(body)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        named = isinstance(choice, dict) and choice.get("type") == "function"  # (OpenAI's forced call)
        what = "a named function" if named else short(choice)
        raise APIError(
            400,
            f"tool_choice={what} is not supported by this server (forcing a call needs constrained "
            "decoding); use 'auto' or 'none'",
            "tool_choice",
        )
    if choice == "auto" and not tools:
        raise APIError(400, "tool_choice 'auto' is only allowed when tools are specified", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        msg = f"parallel_tool_calls={short(parallel)}: expected true or false"
        raise APIError(400, msg, "parallel_tool_calls")
    declared = tools if choice != "none" else []
    msgs = _messages(body)
    limit = None if max_len is None else max_len - 1  # a prompt leaves room for one token at least
    try:
        ids = render(tok, msgs, fmt, declared, max_tokens=limit)
    except PromptTooLong as e:  # its tools or one message: before tens of megabytes are encoded
        raise APIError(400, str(e), e.item, code="context_length_exceeded") from None
    return ids, ChatTurn(fmt.thinking is True, 1 if parallel is False else None, bool(declared))


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools: expected a list of at most {MAX_TOOLS} function tools", "tools")
    names = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or set(t) - {"type", "function"}:
            raise APIError(400, f"{where}: expected {{'type': 'function', 'function': {{...}}}}", where)
        f = t.get("function")
        if not isinstance(f, dict) or set(f) - {"name", "description", "parameters", "strict"}:
            raise APIError(
                400, f"{where}.function: expected name, and optionally description, parameters, strict", where
            )
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            msg = f"{where}.function.name={short(name)}: expected 1-64 of a-z A-Z 0-9 _ -"
            raise APIError(400, msg, f"{where}.function.name")
        if name in names:
            msg = f"{where}.function.name={short(name)}: declared twice"
            raise APIError(400, msg, f"{where}.function.name")
        names.add(name)
        if _depth(f.get("parameters")) > MAX_DEPTH:
            raise APIError(400, f"{where}.function.parameters: nested deeper than {MAX_DEPTH}", where)
        if (odd := odd_field(f)) is not None:
            key, what = odd
            raise APIError(400, f"{where}.function.{key}: expected {what}", f"{where}.function.{key}")
    return tools


def _depth(x: Any) -> int:
    """How deep JSON nests (walked without recursion: a hostile schema must not exhaust the stack)."""
    deepest, todo = 0, [(x, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo += [(w, d + 1) for w in (v.values() if isinstance(v, dict) else v)]
    return deepest


def _messages(body: dict) -> list[Message]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "missing required parameter: 'messages'", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages: expected a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or "role" not in m:
            raise APIError(400, f"{where}: expected an object with 'role' and 'content'", where)
        role = m["role"]
        if not isinstance(role, str) or role not in ROLE_KEYS:
            raise APIError(
                400,
                f"{where}.role={short(role)}: expected 'system', 'developer', 'user', 'assistant' or 'tool'",
                f"{where}.role",
            )
        if (odd := odd_keys(m, ROLE_KEYS[role])) is not None:
            raise APIError(400, f"{where}.{odd} is not supported by this server", f"{where}.{odd}")
        calls = _calls(m.get("tool_calls"), where) if role == "assistant" else ()
        content = m.get("content")
        if content is None and not (role == "assistant" and calls):
            raise APIError(400, f"{where}.content is missing", f"{where}.content")
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise APIError(400, f"{where}.{key}: expected a string", f"{where}.{key}")
        if role == "tool" and m.get("tool_call_id") is None:
            msg = f"{where}.tool_call_id is missing (the call this result answers)"
            raise APIError(400, msg, f"{where}.tool_call_id")
        out.append(
            Message(
                role,
                "" if content is None else _content(content, where),
                m.get("name"),
                m.get("reasoning_content"),
                calls,
                m.get("tool_call_id"),
            )
        )
    return out


def _calls(calls: Any, where: str) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls: expected a list", f"{where}.tool_calls")
    out = []
    for k, c in enumerate(calls):
        at = f"{where}.tool_calls[{k}]"
        f = c.get("function") if isinstance(c, dict) else None
        ok = isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(c.get("id"), str)
        if not ok or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise APIError(400, f"{at}: expected {{id, type: 'function', function: {{name, arguments}}}}", at)
        if not isinstance(f.get("arguments", ""), (str, dict)):  # (an object: rendered as JSON)
            raise APIError(400, f"{at}.function.arguments: expected a JSON string", at)
        out.append(ToolCall.of(c))
    return tuple(out)


def _content(c: Any, where: str) -> str:
    """A message's content (a string or OpenAI's text parts: chat.text_of's rule), else a 400 naming it — the
    part by its index when a list holds one that is not text."""
    if isinstance(c, (str, list)):
        with contextlib.suppress(ValueError):  # (a part that is not text: named below)
            return text_of(c)
    if isinstance(c, list):
        i = next(i for i, p in enumerate(c) if not is_text_part(p))
        at = f"{where}.content[{i}]"
        got = f"type {short(c[i].get('type'))}" if isinstance(c[i], dict) else short(c[i])
        msg = f'{at} ({got}): expected a text part {{"type": "text", "text": "..."}} (images and audio '
        raise APIError(400, msg + "are not supported)", at)
    raise APIError(
        400,
        f"{where}.content: expected a string or a list of text parts (images and audio are not supported)",
        f"{where}.content",
    )


# -- output ---------------------------------------------------------------------------------------
def read_whole(tok: Tokenizer, turn: ChatTurn, ids: list[int], text: str | None) -> ChatParser:
    """A finished choice's output parsed; `text`: its plain text as the engine ended it (cut before a stop
    string)."""
    p = ChatParser(tok, turn.thinking, turn.tools)
    p.push(ids)
    p.finish(None if text is None else len(text))
    return p


def message(p: ChatParser, turn: ChatTurn) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": p.content()}
    if (r := p.reasoning()) is not None:
        msg["reasoning_content"] = r
    calls = p.tool_calls(turn.limit)
    if calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
        msg["content"] = msg["content"] or None  # OpenAI: no text beside the calls is null
    return msg


class ChatStream:
    """One choice of a streamed chat answer: its output parsed as tokens arrive, deltas of what is safe to
    send (what may begin a stop string waits for the next tokens)."""

    def __init__(self, tok: Tokenizer, turn: ChatTurn, stops: tuple[str, ...]):
        self.p, self.turn, self.stops = ChatParser(tok, turn.thinking, turn.tools), turn, stops

    def push(self, ids: list[int], finish: str | None, text: str | None) -> list[dict]:
        p = self.p
        p.push(ids)
        if finish is None:
            return deltas(p.take(len(p.plain) - stop_prefix_len(p.plain, self.stops), limit=self.turn.limit))
        p.finish(None if text is None else len(text))
        return deltas(p.take(len(p.plain), final=True, limit=self.turn.limit))

    def finish_reason(self, reason: str) -> str:
        return self.p.finish_reason(reason, self.turn.limit)

    @property
    def sent(self) -> int:
        """Where the text sent so far ends, in the plain text."""
        return self.p.sent


def deltas(piece: Piece) -> list[dict]:
    """OpenAI chunk deltas of a piece: reasoning, content, then each tool-call fragment (a call's first
    delta carries its id, type and name)."""
    out = []
    if piece.reasoning:
        out.append({"reasoning_content": piece.reasoning})
    if piece.content:
        out.append({"content": piece.content})
    for index, call_id, name, args in piece.calls:
        if call_id is not None:
            head = {"name": name, "arguments": ""}
            call = {"index": index, "id": call_id, "type": "function", "function": head}
        else:
            call = {"index": index, "function": {"arguments": args}}
        out.append({"tool_calls": [call]})
    return out
