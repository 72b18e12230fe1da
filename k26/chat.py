"""The Kimi chat format: messages (tool declarations, tool calls, tool results, thinking) to prompt ids, built
structurally. The other way, an assistant turn's output ids back to reasoning, content and tool calls:
`chat_parser.py`.

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

import contextlib
import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from .chat_tools import check_tools, declare_tools, declared_chars
from .tokenizer import Tokenizer

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
ROLES = ("system", "developer", "user", "assistant", "tool")  # (developer: a system-class turn of its own)


# A chat message dict's keys (OpenAI's, and "reasoning"); EMPTY_OK: what an SDK's own assistant message
# carries back (`message.model_dump()`), fine while it says nothing.
MESSAGE_KEYS = {"role", "content", "name", "reasoning_content", "reasoning", "tool_calls", "tool_call_id"}
EMPTY_OK = {"refusal", "annotations", "audio", "function_call"}


def odd_keys(m: dict, allowed: set[str]):
    """The first key of a message dict (in sorted order) outside `allowed` and not an empty EMPTY_OK one,
    else None."""
    odd = [k for k in m if k not in allowed and (k not in EMPTY_OK or m[k] not in (None, [], {}, ""))]
    return min(odd, key=str) if odd else None


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
        if not isinstance(c, dict):
            raise ValueError(  # noqa: TRY004  (chat input errors are ValueError)
                f"a tool call must be a dict or a k26.ToolCall, got {type(c).__name__}"
            )
        f = c.get("function")
        f = {} if f is None else f
        if not isinstance(f, dict):
            raise ValueError(  # noqa: TRY004  (chat input errors are ValueError)
                f"a tool call's function must be an object {{name, arguments}}, got {type(f).__name__}"
            )
        args = f.get("arguments", "")
        if not isinstance(args, str):
            try:
                args = json.dumps(args, ensure_ascii=False)
            except (TypeError, ValueError) as e:  # a set, a circular object, ...
                raise ValueError(f"a tool call's arguments are not JSON: {e}") from None
        return cls(c.get("id"), f.get("name"), args)

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
        """From a Message or a dict in OpenAI's shape (content a string or a list of text parts, `text_of`;
        reasoning as `reasoning_content`, tool calls as {id, type, function: {name, arguments}})."""
        if isinstance(m, Message):
            return m
        if not isinstance(m, dict):
            raise ValueError(  # noqa: TRY004  (chat input errors are ValueError)
                f"a chat message must be a dict or a k26.Message, got {type(m).__name__}"
            )
        if odd := odd_keys(m, MESSAGE_KEYS):  # (a misspelt "content" rendered an empty turn)
            said = " holds a value (an SDK's field, taken only empty)" if odd in EMPTY_OK else ""
            said = said or f" is not one of {', '.join(sorted(MESSAGE_KEYS))}"
            raise ValueError(f"chat message key {odd!r}{said}")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, (list, tuple)):  # (a dict iterated its keys)
            raise ValueError(
                f"chat message tool_calls must be a list of tool calls, got {type(calls).__name__}"
            )
        return cls(
            m.get("role"),
            text_of(m.get("content")),
            m.get("name"),
            m.get("reasoning_content", m.get("reasoning")),
            tuple(ToolCall.of(c) for c in calls or ()),
            m.get("tool_call_id"),
        )


def is_text_part(p) -> bool:
    """One of OpenAI's text content parts: {"type": "text", "text": str}."""
    return isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)


def text_of(content):
    """A message's content as the templates write it: a string as it is, None as empty, OpenAI's list of
    text parts ({"type": "text", "text": ...}) as their texts one after another; a part of another kind
    (an image: this engine reads text only) raises, named. Anything else is returned for `Message` to name."""
    if content is None:
        return ""
    if not isinstance(content, (list, tuple)):
        return content
    for i, p in enumerate(content):
        if not is_text_part(p):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise ValueError(
                f"chat message content[{i}] ({kind!r}): expected a text part {{'type': 'text', 'text': str}} "
                "(images and audio are not supported)"
            )
    return "".join(p["text"] for p in content)


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
        for name, v in (("thinking", on), ("preserve_thinking", preserve)):
            if v is not None and not isinstance(v, bool):  # (render tests `is True` / `is False`)
                raise ValueError(f"{name}={v!r}: expected True, False or None")
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


class PromptTooLong(ValueError):
    """A conversation whose text alone cannot fit the prompt tokens allowed, seen before any of it is encoded;
    `item`: its part that needs the most of them ("messages[3]", "tools"; "messages" when none needs half)."""

    def __init__(self, item: str, tokens: int, chars: int, limit: int):
        held = f"{chars:,} characters of text; " if chars else ""
        super().__init__(
            f"{item}: {held}the conversation renders to at least {tokens:,} tokens, more than the {limit:,} "
            "a prompt may have"
        )
        self.item = item


def render(
    tok: Tokenizer,
    messages: list[Message | dict],
    fmt: ChatFormat = ChatFormat(),
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    max_tokens: int | None = None,
) -> list[int]:
    """Prompt ids of a conversation (see the module doc); `tools`: OpenAI function declarations.
    `max_tokens`: the most prompt tokens allowed; a conversation whose text cannot fit them whatever it
    encodes to is refused (PromptTooLong) before any of it is encoded (tens of megabytes take seconds)."""
    check_tools(tools)
    if max_tokens is not None and tools:
        _check_declarable(tools, max_tokens, tok)
    pieces = _pieces(tok, messages, fmt, tools, add_generation_prompt)
    if max_tokens is not None:
        _check_fits(pieces, max_tokens, tok)
    ids: list[int] = []
    for owner, p in pieces:
        if isinstance(p, int):
            ids.append(p)
            continue
        try:
            ids += tok.encode(p)
        except ValueError as e:  # (a lone surrogate): which message or declaration holds it
            raise ValueError(f"{owner}: {e}") from None
    return ids


Part = tuple[str, "str | int"]  # (the part of the conversation it is in, a text to encode or a special id)


def _pieces(tok: Tokenizer, messages, fmt: ChatFormat, tools, add_generation_prompt: bool) -> list[Part]:
    """The conversation as the special ids this module inserts and the texts it encodes, in order."""
    sp = tok.token_id
    if isinstance(messages, (str, bytes, dict, Message)) or not hasattr(messages, "__iter__"):
        raise ValueError(  # (chat input errors are ValueError)
            f"messages is a {type(messages).__name__}; expected a list of chat messages"
        )
    msgs = []
    for i, m in enumerate(messages):
        try:
            msgs.append(Message.of(m))
        except ValueError as e:  # which message, as the server's 400 names it
            raise ValueError(f"messages[{i}]: {e}") from None
    if not msgs:  # (only the system turn: nothing asked, as the server's 400 says too)
        raise ValueError("messages is empty: expected at least one chat message")
    owners = [f"messages[{i}]" for i in range(len(msgs))]
    if fmt.default_system is not None and msgs[0].role != "system":
        msgs.insert(0, Message("system", fmt.default_system))
        owners.insert(0, "the default system prompt")
    out: list[Part] = []
    if tools:
        out += _turn(
            tok, "tools", "<|im_system|>", "tool_declare", [declare_tools(tools, fmt.typescript_tools)]
        )
    # K2.5 / K2.6 / K2-Thinking: assistant turns up to the last plain answer (no tool calls) keep an empty
    # think block; the turns after it (the tool-call rounds of the answer being built) keep their reasoning
    answers = [i for i, m in enumerate(msgs) if m.role == "assistant" and not m.tool_calls]
    last_answer = answers[-1] if answers and not fmt.preserve_thinking else -1
    for i, m in enumerate(msgs):
        marker = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}.get(m.role, "<|im_system|>")
        body: list[str | int] = []
        if m.role == "tool":
            body = [f"## Return of {m.tool_call_id}\n{m.content}"]
        elif m.role == "assistant":
            if fmt.thinking is not None or fmt.think_history:
                kept = (m.reasoning or "") if fmt.thinking is not False and i > last_answer else ""
                body += [sp("<think>"), kept, sp("</think>")]
            body.append(m.content)
            if m.tool_calls:
                body.append(sp("<|tool_calls_section_begin|>"))
                for c in m.tool_calls:
                    body += [sp("<|tool_call_begin|>"), c.id, sp("<|tool_call_argument_begin|>")]
                    body += [c.arguments, sp("<|tool_call_end|>")]
                body.append(sp("<|tool_calls_section_end|>"))
        else:
            body = [m.content]
        out += _turn(tok, owners[i], marker, m.name or m.role, body)
    if add_generation_prompt:
        prompt: list[str | int] = [sp("<|im_assistant|>"), "assistant", sp("<|im_middle|>")]
        if fmt.thinking is True:
            prompt.append(sp("<think>"))
        elif fmt.thinking is False:
            prompt += [sp("<think>"), sp("</think>")]
        out += [("the generation prompt", p) for p in prompt]
    return out


def _turn(tok: Tokenizer, owner: str, marker: str, label: str, body: list[str | int]) -> list[Part]:
    sp = tok.token_id
    return [(owner, p) for p in (sp(marker), label, sp("<|im_middle|>"), *body, sp("<|im_end|>"))]


def _check_fits(pieces: list[Part], max_tokens: int, tok: Tokenizer) -> None:
    """PromptTooLong where the pieces need more than `max_tokens` tokens whatever their texts encode to: a
    special id is one token, a text at least `tok.min_tokens` of it."""
    need: dict[str, int] = {}
    chars: dict[str, int] = {}
    for owner, p in pieces:
        if isinstance(p, int):
            need[owner] = need.get(owner, 0) + 1
        else:
            need[owner] = need.get(owner, 0) + tok.min_tokens(len(p))
            chars[owner] = chars.get(owner, 0) + len(p)
    tokens = sum(need.values())
    if tokens > max_tokens:
        item = max(need, key=need.get)
        if 2 * need[item] < tokens:  # many parts, none the cause (thousands of short messages)
            item, held = "messages", sum(n for o, n in chars.items() if o.startswith("messages"))
        else:
            held = chars.get(item, 0)
        raise PromptTooLong(item, tokens, held, max_tokens)


def _check_declarable(tools, max_tokens: int, tok: Tokenizer) -> None:
    """PromptTooLong before the tools' declaration is built (a 31 MB schema takes seconds to write out) where
    the text every form of it holds (`declared_chars`; the tools checked) already needs more than `max_tokens`
    tokens."""
    held = declared_chars(tools)
    if (need := tok.min_tokens(held)) > max_tokens:
        raise PromptTooLong("tools", need, held, max_tokens)
