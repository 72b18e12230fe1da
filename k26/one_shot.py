"""`LLM`'s one-shot calls: `score`, `generate` and `stream` each run their prompts to the end within the call,
in the cache's rows from row 0 (an open continuous batch's unfinished rows refuse them:
continuous_batching.py's calls leave their batch open between calls instead).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from .call_guard import one_at_a_time
from .checks import check_request, check_rows_free, encode_prompts
from .graphs.buckets import pick_bucket
from .memory_plan import check_score_logits
from .outputs import RequestOutput, StreamedText
from .sampling import SamplingParams
from .spec.prefill import prefill
from .spec.step import SpecConfig, verify_nodes
from .tp_driver import surfacing_rank_errors

Prompt = str | Sequence[int]


class OneShotCalls:
    """`score`, `stream`, `generate`: mixed into `LLM`, whose state they use (`decoder`, `cache`, `config`,
    `model`, `tokenizer`, `drafter`, `batch`, `_streaming`) with its `_check_ids`, `_mirror` and
    `_check_workers`."""

    # -- forward -------------------------------------------------------------------------------
    @one_at_a_time
    @torch.inference_mode()
    @surfacing_rank_errors
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [T, vocab] of every position of one sequence (its prefill in cache row 0, a chunk
        of positions per forward)."""
        ids = self._check_ids(token_ids, "token_ids", generating=False)
        check_score_logits(len(ids), self.config.vocab_size, self.device)
        self._overwriting_rows("score()", "score", ids)
        hs: list[torch.Tensor] = []  # each forward's new positions, in order
        m = self.decoder.ctx.models()
        prefill(m, [ids], [0], False, chunk=self.prefill_chunk, each=lambda _i, h, _at: hs.append(h))
        return self.model.logits(torch.cat(hs))

    def _overwriting_rows(self, what: str, name: str, *args) -> None:
        """score / generate / stream / capture write cache rows: refused while a suspended stream or an open
        batch's unfinished rows need theirs; then the ranks are told (`name(*args)`, mirrored) and an open
        batch's prefix cache forgets what its rows held. In that order: a call no rank can take (an argument
        pickle refuses) changes nothing, where a rank 0 that had forgotten its prefixes alone would later
        prefill other positions than its ranks (their collectives mismatched)."""
        check_rows_free(what, self._streaming, self.batch)
        self._mirror(name, *args)
        if self.batch is not None:
            self.batch.overwritten()

    def _prepare(self, prompts, sampling, spec):
        block = None if self.drafter is None else self.drafter.cfg.block_size
        sp, spec = check_request(sampling, spec, block, self.max_model_len, self.config.vocab_size)
        encoded = encode_prompts(prompts, self.tokenizer, self.config.vocab_size, self.max_model_len)
        self._check_bucket(spec, min(len(encoded), self.cache.rows))
        return encoded, sp, spec

    def _check_bucket(self, spec: SpecConfig, rows: int) -> None:
        """With graphs, a bucket must hold `rows` sequences at `spec`'s verify width (the user's `buckets`
        may not): refused here, before the ranks are told (the decoder's own refusal came on every rank)."""
        if self.graphs:
            pick_bucket(self.buckets_for(spec), rows, verify_nodes(spec, self.decoder.ctx.block))

    @one_at_a_time
    def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecConfig | None = None
    ) -> Generator[str, None, RequestOutput]:
        """Yield text increments of one prompt as tokens are accepted (whole UTF-8 characters only); the
        generator returns the finished `RequestOutput`. The arguments are checked here, at the call; the
        decoding starts at the first `next()`."""
        encoded, sp, spec = self._prepare(prompt, sampling, spec)
        if len(encoded) != 1:
            raise ValueError(f"stream() takes one prompt, got {len(encoded)}")
        check_rows_free("stream()", self._streaming, self.batch)
        return self._stream(encoded[0], sp, spec)

    @one_at_a_time(name="stream")
    @torch.inference_mode()
    @surfacing_rank_errors
    def _stream(self, ids: list[int], sp: SamplingParams, spec: SpecConfig):
        # (the rows checked again: a call since stream() may have taken them; mirrored here, not at stream():
        # the ranks run calls in rank 0's order)
        self._overwriting_rows("stream()", "stream", ids, sp, spec)
        text, o = StreamedText(self.tokenizer, sp.stop), None
        steps = self.decoder.run([ids], sp, spec)
        self._streaming = True  # until this generator ends: nothing else may write its row meanwhile
        try:
            for outs in steps:
                o = outs[0]
                if new := text.push(o):
                    yield new
        except GeneratorExit:
            if self._ranks is not None and not self._ranks.closed:  # (closed: no rank is left to pair)
                # The caller stopped iterating early: the ranks run the mirrored stream to its end, so this
                # rank must too, or its next collectives would pair with their leftover ones.
                for _ in steps:
                    pass
            raise
        finally:
            self._streaming = False
        return o  # the finished RequestOutput (stats, finish_reason): StopIteration.value

    @one_at_a_time
    @torch.inference_mode()
    @surfacing_rank_errors
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling: SamplingParams | None = None,
        spec: SpecConfig | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt; a single string or id list counts as one prompt. `spec` picks the decoding
        method (default: DDTree with a drafter loaded, else autoregressive)."""
        encoded, sp, spec = self._prepare(prompts, sampling, spec)
        self._overwriting_rows("generate()", "generate", encoded, sp, spec)
        outs: list[RequestOutput] = []
        for start in range(0, len(encoded), self.cache.rows):
            last = None
            for last in self.decoder.run(encoded[start : start + self.cache.rows], sp, spec):
                pass
            outs += last
        self._check_workers()
        return outs
