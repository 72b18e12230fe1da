"""OpenAI logprobs objects of generated tokens: /v1/completions' {tokens, token_logprobs, top_logprobs,
text_offset} and /v1/chat/completions' {content: [{token, logprob, bytes, top_logprobs}]}.

A token's entry is handed out with the text it begins in, never before: in a stream, tokens whose text is
held back (it may begin a stop string) wait, and at the end the tokens of a cut stop string never go
out. Offsets are in the choice's plain text (special tokens left out), the coordinates stop strings and
streams use. A token that is not whole UTF-8 on its own is written as "bytes:\\xNN..." (as vLLM does).
"""

from __future__ import annotations

from ..sampling import TokenLogprob
from ..tokenizer import TextStream, Tokenizer


class Logprobs:
    """One choice's token logprobs as they arrive, handed out as OpenAI objects (`take`)."""

    def __init__(self, tok: Tokenizer, chat: bool):
        self.tok, self.chat = tok, chat
        self.ts = TextStream(tok)  # where each token's text begins
        self.pending: list[tuple[int, int, TokenLogprob | None]] = []  # (offset, token id, its logprobs)
        self.base = 0  # where the completion's text begins (after an echoed prompt's)

    def echo(self, ids: list[int], lps: list[TokenLogprob | None]) -> str:
        """The prompt first (`echo`: its text and, first token None, its tokens' logprobs); returns its
        text. The completion's offsets then count from the prompt's start, as OpenAI's do."""
        self.push(ids, lps)
        self.base = len(self.ts.finish())  # (a prompt cut mid-character: U+FFFD, as the completion's text)
        return self.ts.text

    @property
    def completion(self) -> str:
        return self.ts.text[self.base :]

    def push(self, ids: list[int], lps: list[TokenLogprob | None]) -> None:
        for i, lp in zip(ids, lps, strict=True):
            self.pending.append((len(self.ts.text), i, lp))
            self.ts.push([i])

    def take(self, upto: int | None = None) -> dict | None:
        """The tokens not handed out yet whose text begins before `upto` of the completion's text (None:
        all), as the endpoint's logprobs object; None when there are none."""
        end = None if upto is None else self.base + upto
        n = len(self.pending) if end is None else sum(1 for off, _, _ in self.pending if off < end)
        out, self.pending = self.pending[:n], self.pending[n:]
        if not out:
            return None
        if self.chat:
            return {
                "content": [{**self._entry(i, lp.logprob), "top_logprobs": self._top(lp)} for _, i, lp in out]
            }
        return {
            "tokens": [self._text(i)[0] for _, i, _ in out],
            "token_logprobs": [lp and lp.logprob for _, _, lp in out],
            # OpenAI: the sampled token's entry is always there (up to logprobs + 1 entries)
            "top_logprobs": [
                lp and {self._text(i)[0]: lp.logprob} | {self._text(j)[0]: v for j, v in lp.top}
                for _, i, lp in out
            ],
            "text_offset": [off for off, _, _ in out],
        }

    def _top(self, lp: TokenLogprob) -> list[dict]:
        return [self._entry(j, v) for j, v in lp.top]

    def _entry(self, i: int, logprob: float) -> dict:
        text, raw = self._text(i)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def _text(self, i: int) -> tuple[str, bytes]:
        raw = self.tok.decode_bytes([i])
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def cut_at(full: str, text: str | None) -> int | None:
    """Where a finished choice's tokens stop counting: the end of `text` when a stop string cut it short
    of the `full` decode, else None (every token)."""
    return len(text) if text is not None and len(text) < len(full) else None
