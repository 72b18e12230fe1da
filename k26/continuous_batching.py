"""`LLM`'s continuous-batching calls: one open batch driven step by step (the server's engine thread).

Every call is mirrored to the TP ranks in order, so their batches admit, step and retire alike. Apart from
engine.py's one-shot calls (`score`, `generate`, `stream`: each runs its prompts to the end within the
call) because these leave the batch open between calls, its rows coming and going.
"""

from __future__ import annotations

import torch

from .batch_state import BatchState
from .call_guard import one_at_a_time
from .checks import check_flags, check_rows_free, check_sampling
from .outputs import RequestOutput
from .sampling import MODES, SamplingParams, builtin_number
from .spec.step import SpecConfig
from .tp_driver import surfacing_rank_errors


class ContinuousBatching:
    """`open_batch`, `admit`, `step`, `release`: mixed into `LLM`, whose state they use (`decoder`, `cache`,
    `config`, `batch`, `_streaming`) with its `_prepare`, `_check_ids`, `_check_bucket` and `_mirror`."""

    batch: BatchState | None

    @one_at_a_time
    @torch.inference_mode()
    @surfacing_rank_errors
    def open_batch(self, spec: SpecConfig | None = None, capacity: int | None = None, logprobs=True):
        """An empty `BatchState` of `capacity` rows (default: every cache row), its graphs captured (the
        "logprobs" mode's unless `logprobs` is False: then no row may ask for logprobs) and its budget costs
        measured; then `admit`, `step` and `release` move requests through it."""
        check_flags(logprobs=logprobs)  # ("no" would capture the logprobs mode's graphs, silently)
        spec = self._prepare([[0]], None, spec)[2]
        # (0 is refused, not taken for None; np.int64 taken as the int it is)
        rows = self.cache.rows if capacity is None else _index(capacity)
        if rows is None or not 1 <= rows <= self.cache.rows:
            raise ValueError(f"capacity={capacity!r}: expected 1..{self.cache.rows} (max_batch)")
        capacity = rows
        self._check_bucket(spec, capacity)
        check_rows_free("open_batch()", self._streaming, self.batch)  # (a previous batch's live rows too)
        self._mirror("open_batch", spec, capacity, logprobs)
        self.batch = self.decoder.open(spec, capacity, MODES if logprobs else MODES[:-1])
        return self.batch

    @one_at_a_time
    @torch.inference_mode()
    @surfacing_rank_errors
    def admit(self, prompts: list[list[int]], params: list[SamplingParams], wait: bool = True) -> list[int]:
        """Checked token-id prompts into free rows (between steps), prefilled now, or (`wait` False) in the
        next steps, `prefill_budget` positions per step while other rows decode; returns their slots."""
        batch = self._open_batch("admit()")
        check_flags(wait=wait)  # ("no" would prefill now, silently)
        for name, xs in (("prompts", prompts), ("params", params)):  # (a str's characters are no prompts)
            if isinstance(xs, (str, bytes, SamplingParams)) or not hasattr(xs, "__len__"):
                raise TypeError(f"admit(): {name} is a {type(xs).__name__}; expected a list, one per request")
        prompts, params = list(prompts), list(params)  # (a NumPy array or 2-d tensor of ids: one row each)
        if len(params) != len(prompts):  # (checked before any row is taken: none is left half admitted)
            raise ValueError(f"admit(): {len(prompts)} prompts but {len(params)} SamplingParams; one each")
        if len(prompts) > len(batch.free_slots()):
            raise ValueError(f"admit(): {len(prompts)} prompts, {len(batch.free_slots())} free rows")
        prompts = [self._check_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        params = [check_sampling(sp, self.config.vocab_size) for sp in params]
        batch.check_params(params)  # (here, not on the ranks: a refusal there leaves them out of step)
        check_rows_free("admit()", self._streaming, None)  # (the batch's own rows are its to manage)
        self._mirror("admit", prompts, params, wait)
        return self.decoder.admit(self.batch, prompts, params, wait)

    @one_at_a_time
    @torch.inference_mode()
    @surfacing_rank_errors
    def step(self) -> list[int]:
        """One step of every live row of the open batch; returns the rows that stepped."""
        self._open_batch("step()")
        check_rows_free("step()", self._streaming, None)
        self._mirror("step")
        return self.decoder.step(self.batch)

    @one_at_a_time
    @torch.inference_mode()
    def release(self, slot: int) -> RequestOutput | None:
        """Free a row (finished, or its request cancelled); returns its output."""
        cap = self._open_batch("release()").capacity
        index = _index(slot)
        if index is None or not 0 <= index < cap:  # (-1 would free another row)
            raise ValueError(f"release(): slot {slot!r} is not a slot of the open batch (0..{cap - 1})")
        slot = index
        self._mirror("release", slot)
        return self.decoder.release(self.batch, slot)

    def _open_batch(self, what: str) -> BatchState:
        """The open batch, or a one-line error naming the call made without one."""
        if self.batch is None:
            raise RuntimeError(f"{what}: no open batch; call open_batch() first")
        return self.batch


def _index(x) -> int | None:
    """x as a Python int if it is an integer (np.int64 too: `builtin_number`), no bool; else None."""
    v = builtin_number(x)
    return v if type(v) is int else None
