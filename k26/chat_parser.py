"""An assistant turn's output ids back to reasoning, content and tool calls, incrementally (for streams): the
Kimi chat format's special tokens read as structure (`ChatParser`), what a stream sends next (`Piece`). The
format itself and the prompt side: `chat.py`."""

from __future__ import annotations

import codecs
import numbers
from dataclasses import dataclass, field

from .chat import ToolCall
from .tokenizer import Tokenizer


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
        if not isinstance(tok, Tokenizer):  # (an LLM passed for its tokenizer failed on an attribute)
            raise TypeError(
                f"ChatParser: tok is a {type(tok).__name__}; expected a Tokenizer (llm.tokenizer)"
            )
        for name, v in (("thinking", thinking), ("tools", tools)):  # ("no" was taken for True)
            if not isinstance(v, bool):
                raise TypeError(f"ChatParser: {name}={v!r}: expected True or False")
        self.tok = tok
        self.finished = False
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
        """More output ids: token ids of this tokenizer's vocabulary (another id was dropped unsaid)."""
        if self.finished:
            raise RuntimeError("ChatParser.push: the output was finished (finish() was called)")
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"ChatParser.push: ids is a {type(ids).__name__}; expected a list of token ids")
        if hasattr(ids, "tolist"):  # a tensor or an array: its ints, as generate() takes them
            ids = ids.tolist()
        ids, n = list(ids), self.tok.n_words
        for at, t in enumerate(ids):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < n:
                raise ValueError(
                    f"ChatParser.push: ids[{at}] = {t!r} is not a token id of this vocabulary [0, {n})"
                )
        ids = [int(t) for t in ids]  # (NumPy integers as the ints they are)
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
        if cut is not None and (not isinstance(cut, numbers.Integral) or isinstance(cut, bool) or cut < 0):
            raise ValueError(f"ChatParser.finish: cut={cut!r}: expected None or a character offset >= 0")
        self.finished = True
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
        ids = [(c, i) for c, i in self._ids().items() if i][: _limit(limit)]
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
        if not isinstance(reason, str):
            raise TypeError(f"ChatParser.finish_reason: reason={reason!r}: expected a finish reason string")
        returned = [c for c, i in self._ids().items() if i][: _limit(limit)]
        return "tool_calls" if reason == "stop" and any(c in self.closed for c in returned) else reason

    def take(self, upto: int, final: bool = False, limit: int | None = None) -> Piece:
        """What the stream has not sent of the plain text before `upto` (held back beyond it: what may
        begin a stop string). A call's id and name go out once its id is complete (its arguments began,
        or the end); its arguments then stream as fragments. `limit` as in `tool_calls`."""
        if isinstance(upto, bool) or not isinstance(upto, numbers.Integral):
            raise TypeError(f"ChatParser.take: upto={upto!r}: expected a position in the text (an int)")
        limit = _limit(limit)
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


def _limit(limit) -> int | None:
    """A call limit: None (all) or a positive int (limit=-1 dropped the last call silently)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral):
        raise TypeError(f"ChatParser: limit={limit!r}: expected None or a positive integer")
    if limit < 1:
        raise ValueError(f"ChatParser: limit={limit!r}: expected None or a positive integer")
    return limit
