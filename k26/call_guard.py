"""`LLM`'s calls one at a time, and none after `close()`; `user_stacklevel`: where the user's call is.

An LLM owns one set of cache rows and one decoder: two calls running together (a `generate()` from each of
two threads, or a thread's `step()` under another's `generate()`) would write the same rows and return
plausible, wrong tokens. A call that finds another running on the same LLM is a RuntimeError naming both;
the same thread may nest calls (a re-entrant lock). Serialising them is the caller's choice (its own lock,
or the batch API / server, whose one engine thread drives the LLM). `close()` waits for a running call, then
refuses every later one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import numbers
import os
import sys
import threading

import torch


class CallGuard:
    """The running call's name and a re-entrant lock; `closed` once the LLM is closed."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.running: str | None = None
        self.closed = False

    def enter(self, what: str) -> bool:
        """Hold the guard for `what` (True: the outermost hold, which `leave` ends), or raise."""
        if self.closed:
            raise RuntimeError(f"LLM.{what}: this LLM is closed; make a new one")
        if not self._lock.acquire(blocking=False):
            if self.closed:  # (close() waits for the running call, then holds the guard while it tears down)
                raise RuntimeError(f"LLM.{what}: this LLM is closed; make a new one")
            raise RuntimeError(
                f"LLM.{what}: LLM.{self.running} is running on this LLM in another thread; an LLM runs one "
                "call at a time (serialise the calls, or drive one open batch from one thread)"
            )
        outer = self.running is None
        if outer:
            self.running = what
        return outer

    def leave(self, outer: bool) -> None:
        if outer:
            self.running = None
        self._lock.release()

    @contextlib.contextmanager
    def closing(self, wait: float | None = None):
        """close()'s hold: it waits for a call running in another thread to return (the server's shutdown
        closes the LLM its engine thread may still be stepping), at most `wait` seconds if given (then it
        tears down regardless: a process on its way out), then marks the LLM closed and tears down with no
        call able to start meanwhile."""
        # (checked before the mark: "x", -5, NaN or 1e12 raised after it, with nothing torn down)
        most = threading.TIMEOUT_MAX
        if wait is not None and (
            isinstance(wait, bool) or not isinstance(wait, numbers.Real) or not 0 <= wait <= most
        ):
            raise ValueError(f"close(wait={wait!r}): expected None or seconds in [0, {most:g}]")
        self.closed = True  # first: a call that finds the guard held from here on is told it is closed
        held = self._lock.acquire(timeout=-1 if wait is None else wait)
        try:
            yield
        finally:
            if held:
                self._lock.release()


def one_at_a_time(method=None, *, name: str | None = None):
    """A method of an object with a `_calls` CallGuard run holding it (`name`: the call as the user made it,
    default the method's). A generator method holds it while it runs up to each yield, not while suspended
    (a suspended stream is refused by its own flag, `LLM._streaming`); closing it closes the method's."""
    if method is None:
        return functools.partial(one_at_a_time, name=name)
    what = f"{name or method.__name__}()"
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def gen(self, *args, **kw):
            inner = method(self, *args, **kw)
            try:
                sent = None
                while True:
                    outer = self._calls.enter(what)
                    try:
                        value = inner.send(sent)
                    except StopIteration as done:
                        return done.value
                    finally:
                        self._calls.leave(outer)
                    sent = yield value
            finally:
                inner.close()  # (abandoned: the method's own GeneratorExit handling runs)

        return gen

    @functools.wraps(method)
    def call(self, *args, **kw):
        outer = self._calls.enter(what)
        try:
            return method(self, *args, **kw)
        finally:
            self._calls.leave(outer)

    return call


_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def user_stacklevel() -> int:
    """warnings.warn's stacklevel, for its caller, of the first frame outside k26 and torch (whose decorators
    wrap the public calls): the warning names the user's line, and Python's once-per-location filter then
    shows it again for another call site, not once per k26 line."""
    frame, level = sys._getframe(2), 2  # warn's caller's caller: stacklevel 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level
