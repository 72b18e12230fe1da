"""What a request gets back: its tokens, text, finish reason, logprobs and speculative-decoding stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import TokenLogprob, stop_prefix_len
from .tokenizer import TextStream, Tokenizer


@dataclass
class SpecStats:
    accepted_per_step: list[int] = field(default_factory=list)  # tokens emitted per target forward
    budgets: list[int] = field(default_factory=list)  # DDTree budget verified at each step
    draft_s: float = 0.0  # eager only: graph steps are one replay with no phase boundaries
    verify_s: float = 0.0
    host_s: float = 0.0  # CPU time between steps, waits excluded (graph mode)
    steps: int = 0

    @property
    def tau(self) -> float:
        """Tokens per target forward (accepted drafts + the bonus), prefill excluded."""
        return sum(self.accepted_per_step) / len(self.accepted_per_step) if self.accepted_per_step else 1.0


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated, without the stop token
    text: str = ""  # decoded token_ids, special tokens left out, cut before a stop string
    finish_reason: str | None = None  # "stop" | "length"; "abort": released (cancelled) before it finished
    stats: SpecStats = field(default_factory=SpecStats)
    # SamplingParams.logprobs: one per token_ids entry (its log-probability, its position's top tokens)
    logprobs: list[TokenLogprob] | None = None
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # prompt tokens whose prefill a cache row already held (prefix_cache.py)


class StreamedText:
    """One output's text as it grows, handed out in increments (`LLM.stream`): whole UTF-8 characters
    only, and what may still begin a stop string held back until the next tokens tell."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self.ts, self.stop, self.sent = TextStream(tokenizer), stop, 0  # sent: characters handed out

    def push(self, o: RequestOutput) -> str:
        """The text `o` adds since the last call ("" if none yet)."""
        self.ts.push(o.token_ids[self.ts.ids :])
        if o.finish_reason == "stop":
            text = o.text  # cut before the stop string (empty when it came first)
            end = len(text)
        elif o.finish_reason is not None:
            text = self.ts.finish()
            end = len(text)
        else:  # what may begin a stop string waits for the next tokens
            text = self.ts.text
            end = len(text) - stop_prefix_len(text, self.stop)
        new, self.sent = text[self.sent : end], max(self.sent, end)
        return new
