"""The engine thread: the only thread that touches the model, its caches and its graphs.

HTTP handlers `submit` requests into a bounded waiting queue and read their tokens from an asyncio queue
that the engine fills through the handler's event loop (`call_soon_threadsafe`), so neither side ever
blocks the other. The `n` choices of one HTTP request are `n` requests (a row each) sharing one queue,
their events tagged with the choice. At every step boundary the engine retires finished and cancelled
rows, admits waiting requests into the free rows (their prefill runs there, between two steps), then
advances every live row by one step (continuous batching).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from ..decode import BatchState
from ..sampling import SamplingParams
from ..spec.step import SpecConfig
from ..tp_driver import RankError
from .errors import SHUTTING_DOWN, APIError
from .metrics import Metrics


def brief(e: BaseException) -> str:
    """An error as a client may read it: its type and first line, then its last line when it has more (a TP
    rank's failure carries that rank's traceback, whose paths are no client's business)."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += f" ... {lines[-1].strip()}"
    return f"{type(e).__name__}: {text}"


class QueueFull(Exception):
    pass


class EngineDown(Exception):
    """The engine thread has stopped (its error is in the message): requests cannot be served."""


@dataclass
class Event:
    """What the engine tells a handler: the request's new tokens, and at the end why it finished (with the
    final text when a stop string cut it), or an error."""

    token_ids: list[int]
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    logprobs: list | None = None  # the new tokens' `TokenLogprob`s (the request asked for logprobs)
    prompt_logprobs: list | None = None  # the first event of a request that asked: its prompt tokens
    cached_tokens: int = 0  # the first event: prompt tokens its row already held (usage's cached_tokens)
    # an error's HTTP status and OpenAI code (503: the server is shutting down, or its engine has stopped)
    status: int = 500
    code: str | None = None

    def http_error(self) -> APIError:
        """This error event as the HTTP error its client gets."""
        return APIError(self.status, self.error, type="server_error", code=self.code)


@dataclass(eq=False)  # identity: the engine looks requests up among its rows
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (choice, Event) items
    choice: int = 0  # which of the HTTP request's choices this row answers
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: bool = False  # set by the handler (client gone); the engine frees the row at the next boundary
    sent: int = 0  # tokens already pushed
    arrived: float = field(default_factory=time.perf_counter)
    first: float | None = None  # when its first token was pushed

    def push(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.choice, ev))
        except RuntimeError:  # the handler's loop is gone (server shutting down)
            self.cancelled = True


class Engine:
    """Owns the `LLM`; `start()` runs the decode loop in its own thread."""

    def __init__(
        self,
        llm,
        spec: SpecConfig,
        max_batch: int | None = None,
        max_waiting: int = 64,
        logprobs: bool = True,
    ):
        self.llm, self.spec = llm, spec
        self.logprobs = logprobs  # the "logprobs" graphs are captured: requests may ask for logprobs
        self.max_batch = min(max_batch or llm.cache.rows, llm.cache.rows)
        self.max_waiting = max_waiting
        self.inbox: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self.waiting: collections.deque[Request] = collections.deque()
        self.pending = 0  # submitted, not yet admitted (inbox + waiting)
        self.lock = threading.Lock()
        self.metrics = Metrics()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.stopping = False  # told to stop: new requests refused, the rest answered when the loop ends
        self.thread = threading.Thread(target=self._main, name="k26-engine", daemon=True)
        self.rows: dict[int, Request] = {}

    # -- HTTP side --------------------------------------------------------------------------------
    def submit(self, reqs: list[Request]) -> None:
        """Queue an HTTP request's rows (its `n` choices) all together, or none of them."""
        # Under the lock, as the engine thread records its failure: a request is either refused here or in
        # the inbox before the failing thread drains it (and answers it), never put after the drain unheard.
        with self.lock:
            if self.stopping:
                raise EngineDown(SHUTTING_DOWN)
            if self.error is not None or (self.ready.is_set() and not self.thread.is_alive()):
                raise EngineDown(f"the engine has stopped ({brief(self.error)}); restart the server")
            if self.pending + len(reqs) > self.max_waiting:
                self.metrics.rejected += len(reqs)
                raise QueueFull(
                    f"the server is at capacity: {self.pending} rows wait for a free slot and this request "
                    f"needs {len(reqs)} (max_waiting={self.max_waiting}); retry later"
                )
            self.pending += len(reqs)
            for req in reqs:
                self.inbox.put(req)
        self.metrics.requests += len(reqs)  # rows: the counters below count rows too

    def start(self, timeout: float = 600.0) -> None:
        self.thread.start()
        self.ready.wait(timeout)
        if self.error is not None:
            raise RuntimeError(f"the engine failed to start: {self.error}") from self.error

    def stop_soon(self) -> None:
        """Refuse new requests and end the loop at the next step boundary, where every request still running
        or waiting is answered with a 503 (the server's shutdown: its handlers then answer their clients
        within the grace period instead of being cancelled mid-answer)."""
        with self.lock:  # (submit: nothing enters the inbox after the stop)
            if not self.stopping:
                self.stopping = True
                self.inbox.put(None)

    def stop(self, wait: float = 30.0) -> None:
        self.stop_soon()
        if self.thread.is_alive():
            self.thread.join(timeout=wait)

    # -- engine thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            with torch.inference_mode():
                # captures graphs, measures the budget's costs; TP ranks mirror every batch call
                state = self.llm.open_batch(self.spec, self.max_batch, self.logprobs)
                self.ready.set()
                while self._take(block=not state.live and not state.pending and not self.waiting):
                    self._boundary(state)
        except BaseException as e:  # noqa: BLE001 - recorded: start() raises it, /health and submit say it
            with self.lock:  # (submit: nothing enters the inbox after this)
                self.error = e
            self.ready.set()
            self._answer_left(Event([], error=f"engine failed: {brief(e)}", status=503, code="engine_down"))
            if self.stopping:  # (a shutdown's own casualties: nothing to report)
                return
            if isinstance(e, RankError):  # one line, not the thread's traceback: the rank's is in it
                print(f"k26: the engine stopped: {brief(e)}", file=sys.stderr)
            else:  # a bug of ours: its traceback, once
                traceback.print_exception(e, file=sys.stderr)
            return
        # told to stop (stop_soon): the server is shutting down
        self._answer_left(Event([], error=SHUTTING_DOWN, status=503, code="server_shutting_down"))

    def _answer_left(self, ev: Event) -> None:
        """Every request still running, waiting or in the inbox hears `ev`: nothing else would answer it."""
        left = []
        with contextlib.suppress(queue.Empty):
            while True:
                item = self.inbox.get_nowait()
                if item is not None:
                    left.append(item)
        for req in list(self.rows.values()) + list(self.waiting) + left:
            req.push(ev)

    def _take(self, block: bool) -> bool:
        """Move submitted requests into the waiting queue; False once told to stop."""
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if item is None:
                    return False
                self.waiting.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return True

    def _boundary(self, state: BatchState) -> None:
        """Retire cancelled rows, admit waiting requests into free rows, then one step of every live row."""
        m, llm = self.metrics, self.llm
        for slot, req in list(self.rows.items()):
            if req.cancelled:
                del self.rows[slot]
                m.cancelled += 1
                with contextlib.suppress(Exception):  # (TP: a dead rank) the step below reports it
                    llm.release(slot)
        gone = [r for r in self.waiting if r.cancelled]  # (their clients left: free their queue places now)
        for req in gone:
            self.waiting.remove(req)
        with self.lock:
            self.pending -= len(gone)
        m.cancelled += len(gone)
        admit = []
        while self.waiting and len(admit) < len(state.free_slots()):
            req = self.waiting.popleft()
            with self.lock:
                self.pending -= 1
            if req.cancelled:
                m.cancelled += 1
                continue
            admit.append(req)
        slots: list[int] = []
        if admit:
            try:
                # prefilled in the steps (a budget of positions each while rows decode): a long prompt
                # does not stall the streams already running
                slots = llm.admit([r.prompt_ids for r in admit], [r.params for r in admit], wait=False)
            except Exception as e:  # noqa: BLE001 - refused, or rolled back (admission.admit): these rows only
                err = Event([], error=brief(e))
                for req in admit:
                    req.push(err)
                admit = []
            self.rows.update(zip(slots, admit))
            m.prompt_tokens += sum(len(r.prompt_ids) for r in admit)
            self._count_rows()  # before the step: it may be a long prefill
        try:
            if slots:
                self._publish(state, slots)  # (rows that generate nothing finish here)
            if state.live or state.pending:
                t0, rows0, tokens0 = time.perf_counter(), state.forward_rows, state.forward_tokens
                stepped = llm.step()  # (rows whose prefill ends in it are stepped too)
                m.steps, m.step_seconds = m.steps + 1, m.step_seconds + time.perf_counter() - t0
                m.row_steps += state.forward_rows - rows0
                m.step_tokens += state.forward_tokens - tokens0
                self._publish(state, stepped)
        except Exception as e:  # a failed step fails its requests, not the server...
            if llm.broken:  # ...unless no later step can succeed (a TP rank died): the engine ends (503s)
                raise
            err = Event([], error=brief(e))
            for slot, req in list(self.rows.items()):
                req.push(err)
                with contextlib.suppress(Exception):  # the row goes whatever state the batch is in
                    llm.release(slot)
                del self.rows[slot]
        self._count_rows()

    def _count_rows(self) -> None:
        """The gauges: rows in the batch (from admission on, still prefilling included) and rows waiting."""
        self.metrics.running, self.metrics.waiting = len(self.rows), self.pending

    def _publish(self, state: BatchState, slots: list[int]) -> None:
        """Push each row's new tokens to its handler; finished rows leave the batch. The metrics count a
        row's tokens (and its end) before its handler is woken: a client that has its answer finds it in
        /metrics."""
        m, now, total = self.metrics, time.perf_counter(), 0
        for slot in slots:
            req, out = self.rows.get(slot), state.outs[slot]
            if req is None or out is None:
                continue
            new = out.token_ids[req.sent :]
            lps = None if out.logprobs is None else out.logprobs[req.sent : req.sent + len(new)]
            pl = out.prompt_logprobs if req.sent == 0 else None  # (the first publish always pushes)
            hit = out.cached_tokens if req.sent == 0 else 0
            if req.sent == 0 and (new or out.finish_reason is not None):
                m.cached_tokens += out.cached_tokens
            req.sent += len(new)
            total += len(new)
            m.generated_tokens += len(new)
            if new and req.first is None:
                req.first = now
                m.ttft.observe(now - req.arrived)
            if out.finish_reason is None:
                if new:
                    req.push(Event(new, logprobs=lps, prompt_logprobs=pl, cached_tokens=hit))
                continue
            m.e2e.observe(now - req.arrived)
            if req.first is not None and req.sent > 1:
                m.tpot.observe((now - req.first) / (req.sent - 1))
            m.finished += 1
            req.push(
                Event(new, out.finish_reason, out.text, logprobs=lps, prompt_logprobs=pl, cached_tokens=hit)
            )
            self.llm.release(slot)
            del self.rows[slot]
        m.recent.append((now, total))
