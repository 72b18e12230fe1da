"""The Kimi chat format, both ways: messages (tool declarations, tool calls, tool results, thinking) to
prompt ids, built structurally; and an assistant turn's output ids back to reasoning, content and tool
calls (`ChatParser`, incremental, for streams).

The layout follows the K2 / K2.5 / K2.6 chat template as published (checked against public renderings of
it; no checkpoint's Jinja file is executed): `<|im_{user,assistant,system}|>{name or role}<|im_middle|>
{body}<|im_end|>` per turn; tools declared first, as `<|im_system|>tool_declare<|im_middle|>{tools}
<|im_end|>` (K2.5 / K2.6: the TypeScript-style declaration their tokenizer code writes, `chat_tools.py`;
K2, or a schema that form does not cover: the template's JSON branch, compact, key-sorted); a tool call
as `<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{JSON}<|tool_call_end|>` inside
one `<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>` per turn; a tool result as a
system-class turn `## Return of {id}\\n{content}`. K2.5 / K2.6 think: the generation prompt opens `<think>`
(or closes an empty one when thinking is off), and an assistant turn up to the last plain answer keeps
only an empty `<think></think>` (K2.6's preserve_thinking: every turn its reasoning); K2-Thinking's turns
carry think blocks the same way, its generation prompt opens none.

Security: every string from a message is encoded as ordinary text, so "<|im_end|>" typed by a user
becomes plain BPE pieces, never the control token; only this module inserts special ids.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from .chat_tools import typescript_tools
from .tokenizer import Tokenizer

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
ROLES = ("system", "developer", "user", "assistant", "tool")  # (developer: a system-class turn of its own)


@dataclass(frozen=True)
class ToolCall:
    id: str  # as the model writes it: "functions.{name}:{index in the turn}"
    name: str
    arguments: str  # JSON text as generated (a client checks it before running anything)

    def __post_init__(self) -> None:
        for f in ("id", "name", "arguments"):
            if not isinstance(getattr(self, f), str):
                raise ValueError(  # noqa: TRY004  (all chat-message validation errors are ValueError)
                    f"tool call {f} must be a string, got {type(getattr(self, f)).__name__}"
                )

    @classmethod
    def of(cls, c: ToolCall | dict) -> ToolCall:
        """From a ToolCall or OpenAI's {id, type, function: {name, arguments}} (arguments as a JSON string,
        or an object, rendered as JSON the way the template renders a non-string)."""
        if isinstance(c, ToolCall):
            return c
        f = c.get("function") or {}
        args = f.get("arguments", "")
        return cls(
            c.get("id"),
            f.get("name"),
            args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        )

    @staticmethod
    def name_of(call_id: str) -> str:
        """The function name inside a Kimi call id ("functions.get_weather:0" -> "get_weather")."""
        return call_id.split(":")[0].split(".")[-1].strip()


@dataclass(frozen=True)
class Message:
    role: str  # one of ROLES
    content: str = ""
    name: str | None = None  # the turn's label instead of its role (a tool result: the function's name)
    reasoning: str | None = None  # assistant: its thinking (rendered only in K2.5 / K2.6's last turns)
    tool_calls: tuple[ToolCall, ...] = ()  # assistant
    tool_call_id: str | None = None  # tool: the call this result answers

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"chat message role {self.role!r} is not one of {', '.join(map(repr, ROLES))}")
        for f in ("content", "name", "reasoning", "tool_call_id"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"chat message {f} must be a string, got {type(v).__name__}")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"chat message role {self.role!r} cannot carry tool_calls (only 'assistant')")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' chat message needs the tool_call_id it answers")
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    @classmethod
    def of(cls, m: Message | dict) -> Message:
        """From a Message or a dict in OpenAI's shape (reasoning as `reasoning_content`, tool calls as
        {id, type, function: {name, arguments}})."""
        if isinstance(m, Message):
            return m
        return cls(
            m.get("role"),
            m.get("content") or "",
            m.get("name"),
            m.get("reasoning_content", m.get("reasoning")),
            tuple(ToolCall.of(c) for c in m.get("tool_calls") or ()),
            m.get("tool_call_id"),
        )


@dataclass(frozen=True)
class ChatFormat:
    """How a model's chat template renders a conversation."""

    # K2.5 / K2.6: True opens `<think>` for the answer, False closes an empty one; None (K2): no think tags
    thinking: bool | None = None
    default_system: str | None = None  # the system turn put first when the conversation has none
    preserve_thinking: bool = False  # K2.6: every earlier assistant turn keeps its reasoning (agents)
    typescript_tools: bool = False  # K2.5 / K2.6: tools declared TypeScript-style (else JSON)
    think_history: bool = False  # K2-Thinking: assistant turns carry think blocks, its prompt opens none

    @classmethod
    def for_model(cls, model_type: str, template: str | None = None) -> ChatFormat:
        """The template of a checkpoint's model_type: kimi_k25 (K2.5 / K2.6) thinks by default; K2
        (kimi_k2, deepseek_v3) adds no think tags — unless its chat `template` (text) has them: K2-Thinking,
        whose assistant turns carry think blocks and whose model opens its own `<think>`."""
        k25 = model_type == "kimi_k25"
        k2_thinking = not k25 and template is not None and "<think>" in template
        return cls(True if k25 else None, DEFAULT_SYSTEM, typescript_tools=k25, think_history=k2_thinking)

    @classmethod
    def of_checkpoint(cls, path: str | Path, model_type: str) -> ChatFormat:
        """`for_model` with the template the checkpoint ships (chat_template.jinja, or tokenizer_config.json's
        chat_template), read only to tell K2-Thinking from K2: prompts are built here, never by the Jinja."""
        files = [Path(path) / n for n in ("chat_template.jinja", "tokenizer_config.json")]
        stamp = tuple((f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else None for f in files)
        return cls.for_model(model_type, _shipped_template(str(path), stamp))

    def with_thinking(self, on: bool | None, preserve: bool | None = None) -> ChatFormat:
        """Thinking switched per request (chat_template_kwargs `thinking`, K2.6's `preserve_thinking`);
        None keeps the default."""
        if on is None and preserve is None:
            return self
        if self.thinking is None:
            raise ValueError("this model's chat format has no thinking switch (K2.5 / K2.6 only)")
        keep = self.preserve_thinking if preserve is None else preserve
        return dataclasses.replace(self, thinking=self.thinking if on is None else on, preserve_thinking=keep)


@functools.lru_cache(maxsize=8)  # (LLM.chat_ids builds every prompt through it: read once per file version)
def _shipped_template(path: str, stamp: tuple) -> str | None:
    """The chat template a checkpoint ships (chat_template.jinja, else tokenizer_config.json's), or None;
    `stamp`: the two files' (mtime, size), so an edited file is read again."""
    d, text = Path(path), None
    if (d / "chat_template.jinja").is_file():
        text = (d / "chat_template.jinja").read_text(errors="replace")
    elif (d / "tokenizer_config.json").is_file():
        with contextlib.suppress(ValueError, OSError):
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            t = cfg.get("chat_template") if isinstance(cfg, dict) else None
            text = t if isinstance(t, str) else json.dumps(t) if t is not None else None
    return text


def render(
    tok: Tokenizer,
    messages: list[Message | dict],
    fmt: ChatFormat = ChatFormat(),
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Prompt ids of a conversation (see the module doc); `tools`: OpenAI function declarations."""
    sp = tok.token_id
    msgs = [Message.of(m) for m in messages]
    if fmt.default_system is not None and (not msgs or msgs[0].role != "system"):
        msgs.insert(0, Message("system", fmt.default_system))
    ids: list[int] = []
    if tools:
        ids += _turn(tok, "<|im_system|>", "tool_declare", tok.encode(declare_tools(tools, fmt)))
    # K2.5 / K2.6 / K2-Thinking: assistant turns up to the last plain answer (no tool calls) keep an empty
    # think block; the turns after it (the tool-call rounds of the answer being built) keep their reasoning
    answers = [i for i, m in enumerate(msgs) if m.role == "assistant" and not m.tool_calls]
    last_answer = answers[-1] if answers and not fmt.preserve_thinking else -1
    for i, m in enumerate(msgs):
        marker = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}.get(m.role, "<|im_system|>")
        label = m.name or m.role
        if m.role == "tool":
            body = tok.encode(f"## Return of {m.tool_call_id}\n{m.content}")
        elif m.role == "assistant":
            body = []
            if fmt.thinking is not None or fmt.think_history:
                kept = (m.reasoning or "") if fmt.thinking is not False and i > last_answer else ""
                body += [sp("<think>"), *tok.encode(kept), sp("</think>")]
            body += tok.encode(m.content)
            if m.tool_calls:
                body.append(sp("<|tool_calls_section_begin|>"))
                for c in m.tool_calls:
                    body += [sp("<|tool_call_begin|>"), *tok.encode(c.id), sp("<|tool_call_argument_begin|>")]
                    body += [*tok.encode(c.arguments), sp("<|tool_call_end|>")]
                body.append(sp("<|tool_calls_section_end|>"))
        else:
            body = tok.encode(m.content)
        ids += _turn(tok, marker, label, body)
    if add_generation_prompt:
        ids += [sp("<|im_assistant|>"), *tok.encode("assistant"), sp("<|im_middle|>")]
        if fmt.thinking is True:
            ids.append(sp("<think>"))
        elif fmt.thinking is False:
            ids += [sp("<think>"), sp("</think>")]
    return ids


def _turn(tok: Tokenizer, marker: str, label: str, body: list[int]) -> list[int]:
    sp = tok.token_id
    return [sp(marker), *tok.encode(label), sp("<|im_middle|>"), *body, sp("<|im_end|>")]


def declare_tools(tools: list[dict], fmt: ChatFormat) -> str:
    """The text of the tool_declare turn: TypeScript-style where the format uses it and the schemas allow,
    else compact, key-sorted JSON (what the reference falls back to)."""
    if fmt.typescript_tools:
        try:
            return typescript_tools(tools)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            pass  # (the reference's tokenizer falls back to the JSON on any failure of the conversion)
    return json.dumps(tools, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


# -- output -----------------------------------------------------------------------------------------
@dataclass
class Part:
    """A run of an assistant output's text in one channel: "reasoning", "content", or a tool call's "id"
    or "args" (`call`: which call of the turn, counting from 0). `start`: where it begins in the output's
    plain text (every ordinary token's text, special tokens left out, as `TextStream` decodes it)."""

    kind: str
    call: int
    start: int
    text: str = ""


@dataclass
class Piece:
    """What a stream sends next for one choice: reasoning and content text, and tool-call deltas
    (index among the calls returned, id and name on a call's first delta, else None, and an arguments
    fragment)."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, str | None, str | None, str]] = field(default_factory=list)


class ChatParser:
    """An assistant turn's output ids, as they come, split into reasoning, content and tool calls by the
    format's special tokens (`thinking`: the prompt opened `<think>`, so the output starts in reasoning;
    `tools`: tool calls are read, else their markers are left out like any other special token and the
    calls' text stays where it is). Structure comes only from special ids in an order the format allows;
    any other special id is left out, as plain decoding leaves it out, and no text is ever dropped.

    Grammar: `<think>` first opens reasoning (K2-Thinking opens its own), `</think>` ends it; a call is
    `<|tool_call_begin|>` id `<|tool_call_argument_begin|>` arguments `<|tool_call_end|>`, inside a
    `<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>` section (which also ends reasoning) or
    not; text between calls is content. A call is returned only once its id has text."""

    def __init__(self, tok: Tokenizer, thinking: bool, tools: bool = True):
        self.tok = tok
        names = MARKERS if tools else MARKERS[:2]
        self.sp = {tok.special_ids[n]: n for n in names if n in tok.special_ids}
        self.parts: list[Part] = [Part("reasoning" if thinking else "content", -1, 0)]
        self.reasoned = thinking  # a reasoning channel exists (opened by the prompt or the model)
        self.plain = ""  # the plain text so far (stop strings are searched in it)
        self.calls = 0  # calls begun
        self.closed: dict[int, int] = {}  # calls whose <|tool_call_end|> came: where in the plain text
        self._resume = "content"  # the channel a call's end returns to
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.sent = 0  # plain characters handed out by `take`
        self._index: dict[int, int] = {}  # calls `take` has headed: their index among the calls returned
        self._dropped: set[int] = set()  # calls `take` will not return (no id; past `limit`)

    # -- input -------------------------------------------------------------------------------
    def push(self, ids: list[int]) -> None:
        run: list[int] = []
        for t in ids:
            if t < self.tok.num_base:
                run.append(t)
                continue
            # (the decoder keeps a character's first bytes across a marker, as plain decoding joins them)
            self._text(self._utf8.decode(self.tok.decode_bytes(run)))
            run = []
            if t in self.sp:
                self._marker(self.sp[t])
        self._text(self._utf8.decode(self.tok.decode_bytes(run)))

    def finish(self, cut: int | None = None) -> None:
        """The output is complete; `cut`: its plain text ends there (a stop string began there)."""
        self._text(self._utf8.decode(b"", final=True))
        if cut is not None and cut < len(self.plain):
            self.plain = self.plain[:cut]
            self.parts = [self.parts[0]] + [p for p in self.parts[1:] if p.start < cut]
            for p in self.parts:
                p.text = p.text[: max(cut - p.start, 0)]
            # a marker at the cut came before the stop string's first character
            self.closed = {c: at for c, at in self.closed.items() if at <= cut}

    def _text(self, s: str) -> None:
        if s:
            self.parts[-1].text += s
            self.plain += s

    def _marker(self, name: str) -> None:
        kind, call = self.parts[-1].kind, self.parts[-1].call
        new = None
        if name == "<think>" and kind == "content" and not self.plain and len(self.parts) == 1:
            new, self.reasoned = ("reasoning", -1), True
        elif name == "</think>" and kind == "reasoning":
            new = ("content", -1)
        elif (
            name == "<|tool_calls_section_begin|>"
            and kind in ("reasoning", "content")
            or name == "<|tool_calls_section_end|>"
        ):
            new, self._resume = ("content", -1), "content"
        elif name == "<|tool_call_begin|>":  # (inside an unfinished call: that one stays unclosed)
            if kind in ("reasoning", "content"):
                self._resume = kind
            new, self.calls = ("id", self.calls), self.calls + 1
        elif name == "<|tool_call_argument_begin|>" and kind == "id":
            new = ("args", call)
        elif name == "<|tool_call_end|>" and kind in ("id", "args"):
            new, self.closed[call] = (self._resume, -1), len(self.plain)
        if new is not None and new != (kind, call):
            self.parts.append(Part(new[0], new[1], len(self.plain)))

    # -- views ----------------------------------------------------------------------------------
    def reasoning(self) -> str | None:
        """The thinking text (None when the turn has no reasoning channel)."""
        return "".join(p.text for p in self.parts if p.kind == "reasoning") if self.reasoned else None

    def content(self) -> str:
        return "".join(p.text for p in self.parts if p.kind == "content")

    def _ids(self) -> dict[int, str]:
        ids: dict[int, str] = {}
        for p in self.parts:
            if p.kind == "id":
                ids[p.call] = ids.get(p.call, "") + p.text
        return {c: i.strip() for c, i in ids.items()}

    def tool_calls(self, limit: int | None = None) -> list[ToolCall]:
        """The turn's calls in order (a call cut short by max_tokens included: the finish reason says so),
        those without an id left out; `limit`: at most that many (parallel_tool_calls = false: one)."""
        ids = [(c, i) for c, i in self._ids().items() if i][:limit]
        return [
            ToolCall(
                i,
                ToolCall.name_of(i),
                "".join(p.text for p in self.parts if p.kind == "args" and p.call == c),
            )
            for c, i in ids
        ]

    def finish_reason(self, reason: str, limit: int | None = None) -> str:
        """ "tool_calls" when a turn that stopped by itself returns a complete call."""
        returned = [c for c, i in self._ids().items() if i][:limit]
        return "tool_calls" if reason == "stop" and any(c in self.closed for c in returned) else reason

    def take(self, upto: int, final: bool = False, limit: int | None = None) -> Piece:
        """What the stream has not sent of the plain text before `upto` (held back beyond it: what may
        begin a stop string). A call's id and name go out once its id is complete (its arguments began,
        or the end); its arguments then stream as fragments. `limit` as in `tool_calls`."""
        piece, lo, ids = Piece(), self.sent, None
        for k, p in enumerate(self.parts):
            if p.kind in ("id", "args"):
                c = p.call
                if c not in self._index and c not in self._dropped:
                    complete = final or (k + 1 < len(self.parts) and self.parts[k + 1].start <= upto)
                    if p.kind != "id" or not complete:
                        continue
                    ids = ids or self._ids()
                    if not ids[c] or (limit is not None and len(self._index) >= limit):
                        self._dropped.add(c)
                        continue
                    self._index[c] = len(self._index)
                    piece.calls.append((self._index[c], ids[c], ToolCall.name_of(ids[c]), ""))
                if c in self._dropped or p.kind == "id":
                    continue
            a, b = max(lo, p.start), min(upto, p.start + len(p.text))
            if b <= a:
                continue
            s = p.text[a - p.start : b - p.start]
            if p.kind == "reasoning":
                piece.reasoning += s
            elif p.kind == "content":
                piece.content += s
            else:
                piece.calls.append((self._index[p.call], None, None, s))
        self.sent = max(self.sent, upto)
        return piece


MARKERS = (
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
)
