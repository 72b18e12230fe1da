"""Tensor parallel driven from one Python process: `LLM(tp=N)` becomes rank 0 and starts ranks 1..N-1 as
`k26.tp_rank.run_rank` processes, each building the same object and mirroring every call made on it.

Why fresh interpreters and not multiprocessing's spawn: spawn re-runs the parent's `__main__` in every
child, which fails when the script came on standard input, from a REPL or a notebook. A rank here runs
only this module; what it builds comes as a pickled reference (`k26.engine.LLM`), so this module
imports nothing above it. Messages travel as pickles over the rank's own stdin / stdout pipes (its
prints go to stderr, which is kept in a temporary file for error reports).

Failures: rank 0 joins the process group only after every rank has said it is joining, watching the
processes meanwhile, so a rank that dies at start-up fails the parent within seconds with its own
error text instead of a rendezvous timeout. A rank whose call fails reports the traceback and exits,
which breaks the collectives the parent waits in; `surface` then raises that rank's text.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from . import dist as k26_dist

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)  # so a rank imports this very k26


class RankError(RuntimeError):
    """A tensor-parallel rank process failed; the message carries that rank's own error text, `summary` the
    failure in a line ("rank 1: killed by SIGKILL"; None for a group's refusal of a further call)."""

    def __init__(self, message: str, summary: str | None = None):
        super().__init__(message)
        self.summary = summary


class _Rank:
    """One rank process: its pipes, its stderr file and a reader thread turning its messages into a queue."""

    def __init__(self, rank: int):
        self.rank = rank
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  (open for the rank's life; closed by RankGroup.close)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])),
            K26_PARENT_PID=str(os.getpid()),  # (the rank leaves with its parent: `_tied_to_parent`)
        )
        self.proc = subprocess.Popen(
            # (-c, not -m: the package imports this module first, and runpy then warned on each rank's stderr,
            # so at the head of every rank failure's message, that it was "found in sys.modules")
            [sys.executable, "-c", "from k26.tp_rank import run_rank; run_rank()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
        )
        self.inbox: queue.Queue = queue.Queue()
        self.sent = self.done = 0  # calls mirrored to this rank, and those it finished ("done")
        threading.Thread(target=self._read, daemon=True, name=f"k26-rank{rank}-reader").start()

    def _read(self) -> None:
        with contextlib.suppress(EOFError, OSError, pickle.UnpicklingError):
            while True:
                msg = pickle.load(self.proc.stdout)
                if msg[0] == "done":
                    self.done += 1
                else:
                    self.inbox.put(msg)
        self.inbox.put(("exit", None))

    def send(self, msg) -> None:
        self.send_bytes(pickle.dumps(msg))

    def send_bytes(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the rank is gone: its exit is reported by `failure`

    def raise_failure(self, kind: str, payload) -> None:
        """This rank's failure: a user's error (bad checkpoint, TP size...) as itself, as rank 0's own would
        be raised; anything else as a RankError carrying the rank's traceback or exit."""
        if kind == "error" and payload[0] is not None:
            raise payload[0]
        line, text = self.failure(kind, payload)
        raise RankError(f"tensor-parallel rank {self.rank} failed: {text}", f"rank {self.rank}: {line}")

    def failure(self, kind: str, payload) -> tuple[str, str]:
        """(the failure in a line, its whole text)."""
        if kind == "error":  # (the rank's error, its traceback text): its last line says it
            return payload[1].strip().splitlines()[-1].strip(), payload[1]
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = "unknown (still running, its message pipe closed)"
        how = (
            f"killed by {signal.Signals(-code).name}"
            if isinstance(code, int) and code < 0
            else f"exited with status {code}"
        )
        self.log.seek(0)
        tail = b"".join(self.log.readlines()[-25:]).decode(errors="replace").rstrip()
        if not tail:
            return f"{how} with nothing on stderr", f"{how} with nothing on stderr"
        return how, f"{how}; its stderr ends:\n{tail}"


def _late(rank: int, want: str) -> RankError:
    wait = k26_dist.timeout().total_seconds()  # (a rank's start alone takes seconds: a short wait says why)
    late = f"rank {rank} sent no '{want}' within {wait:g} s (K26_DIST_TIMEOUT)"
    return RankError(f"tensor-parallel {late}", late)


class RankGroup:
    """Ranks 1..world-1 of a process group whose rank 0 is this process."""

    driving: RankGroup | None = None  # the last group this process joined as rank 0 (`group_found`)

    def __init__(self, world: int, factory, args: tuple, kwargs: dict, device: str | None):
        """Start the ranks, have each build `factory(*args, **kwargs)` once joined, and join as rank 0."""
        self.world = world
        self.ranks: list[_Rank] = []
        self.closed = False
        self._left: str | None = None  # a call rank 0 left while the ranks ran it: they are out of step
        self._failed: str | None = None  # the first rank failure seen: the group can run no further call
        self._last = ""  # the last call mirrored
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=k26_dist.timeout()
        )
        try:
            threads = max(1, (os.cpu_count() or 1) // world)
            for r in range(1, world):
                rank = _Rank(r)
                self.ranks.append(rank)
                init = {
                    "rank": r,
                    "world": world,
                    "port": store.port,
                    "device": device,
                    "threads": threads,
                    "factory": factory,
                    "args": args,
                    "kwargs": kwargs,
                }
                rank.send(init)
            for rank in self.ranks:
                self._expect(rank, "joining", deadline=time.monotonic() + k26_dist.timeout().total_seconds())
            k26_dist.init_group(0, world, device, store=store)
            RankGroup.driving, self._group = self, dist.group.WORLD
        except BaseException:  # interrupted too: never leave ranks behind
            self.close(kill=True)
            raise
        self._store = store  # the group's rendezvous lives in this process: keep it as long as the group

    def _expect(self, rank: _Rank, want: str, deadline: float):
        """The payload of `rank`'s next `want` message (raising the rank's failure, or lateness, instead)."""
        while True:
            try:
                kind, payload = rank.inbox.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise _late(rank.rank, want) from None
                continue
            if kind == want:
                return payload
            rank.raise_failure(kind, payload)

    def wait_ready(self) -> None:
        """Every rank has built its object (raises the first rank's failure); k26's warnings on a rank while
        it built (a load cache it could not write: every start re-reads the checkpoint) are warned here too,
        where the user sees them, not left in the rank's stderr file."""
        for rank in self.ranks:
            said = self._expect(rank, "ready", deadline=time.monotonic() + k26_dist.timeout().total_seconds())
            for text in said or ():
                warnings.warn(f"tensor-parallel rank {rank.rank}: {text}", UserWarning, stacklevel=2)

    def mirror(self, name: str, *args, **kw) -> None:
        """Every rank calls `name(*args, **kw)` on its object (a generator is run to its end); refused once
        rank 0 left a call the ranks ran (their collectives would pair with that call's leftovers)."""
        if why := self.broken:
            raise RankError(f"this LLM's tensor-parallel ranks {why}")
        try:  # (once, before any rank is told: a call no rank can take leaves them all in step)
            data = pickle.dumps((name, args, kw))
        except Exception as e:  # noqa: BLE001  (pickling raises PicklingError, AttributeError, TypeError...)
            raise TypeError(
                f"{name}(): an argument cannot be sent to the tensor-parallel ranks: {e}"
            ) from None
        for rank in self.ranks:
            rank.sent += 1
            rank.send_bytes(data)
        self._last = name

    @property
    def broken(self) -> str | None:
        """Why the group can run no further call (closed, out of step, a rank failed), else None."""
        if self.closed:
            return "are closed"
        if self._failed or self._left:
            why = f"failed ({self._failed})" if self._failed else f"are out of step: {self._left}"
            return f"{why}; close() it and make a new LLM"
        return None

    def check(self, wait: float = 0.0) -> None:
        """Raise the failure of any rank that reported one (waiting up to `wait` s for one to arrive)."""
        deadline = time.monotonic() + wait
        while True:
            for rank in self.ranks:
                with contextlib.suppress(queue.Empty):
                    kind, payload = rank.inbox.get_nowait()
                    if kind in ("joining", "ready"):
                        continue
                    rank.raise_failure(kind, payload)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    @contextlib.contextmanager
    def surface(self):
        """A collective that failed because a rank died raises that rank's own error text instead. A call
        that leaves (an interrupt, an error) after its ranks were told to make it leaves them out of step."""
        sent = sum(r.sent for r in self.ranks)
        try:
            yield
        except GeneratorExit:  # (a stream closed early: `LLM.stream` ran its ranks' part to the end)
            raise
        except BaseException as e:
            found = e if isinstance(e, RankError) else None
            # A broken collective is a RuntimeError (gloo / NCCL): give the rank's report a moment to
            # arrive. Anything else (this rank's own bad input or checkpoint error) raises as it is: a
            # rank that found the same problem first must not replace it with its own report.
            if isinstance(e, RuntimeError) and found is None:
                try:
                    self.check(wait=5.0)
                except RankError as reported:
                    found = reported
            if found is not None:
                self._failed = self._failed or found.summary  # (the group's own refusals have none)
            elif sum(r.sent for r in self.ranks) != sent and self._left is None:
                self._left = f"rank 0 left {self._last}() on {type(e).__name__} while the other ranks ran it"
            if found is not None and found is not e:
                raise found from e
            raise

    def close(self, kill: bool = False) -> None:
        """Tell the ranks to leave (or kill them) and wait for them; idempotent. Ranks still in a call that
        rank 0 left (interrupted; a stream suspended) would wait in its collectives, not read the request to
        leave: killed after a moment for their last call to finish."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + (0 if self._left else 3)
        while not kill and not self._idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        kill = kill or not self._idle()
        for rank in self.ranks:
            if kill:
                rank.proc.kill()
            else:
                rank.send(None)
            with contextlib.suppress(OSError):
                rank.proc.stdin.close()
        for rank in self.ranks:
            try:
                rank.proc.wait(timeout=0 if kill else 60)
            except subprocess.TimeoutExpired:
                rank.proc.kill()
                rank.proc.wait()
            rank.log.close()

    def _idle(self) -> bool:
        """Every rank finished every call mirrored to it (or has exited)."""
        return all(r.done >= r.sent or r.proc.poll() is not None for r in self.ranks)


def group_found() -> bool:
    """Whether this process is in a process group already (an `LLM(tp=N)` then uses it, starting no ranks).
    An earlier `LLM(tp=N)` dropped without `close()` is collected first (it is unreachable only, a
    reference cycle; its finalizer stops its ranks) and its group, which the finalizer may not tear down
    under live CUDA graphs, destroyed here: found, it paired this LLM's collectives with ranks that had
    left (a hang until the group's timeout). One still in use (`llm = LLM(tp=2)` run twice: the old one is
    bound while the new one is built) holds the ranks: refused by name."""
    old = RankGroup.driving
    if old is not None and not old.closed:
        gc.collect()  # (an unreachable LLM's finalizer closes its ranks)
    if old is not None and not old.closed:
        raise ValueError(
            f"another LLM(tp={old.world}) of this process still holds its tensor-parallel ranks: "
            "close() it before making a new one"
        )
    if old is not None and dist.is_initialized() and dist.group.WORLD is old._group:
        dist.destroy_process_group()
    RankGroup.driving = None
    return dist.is_initialized()


def surfacing_rank_errors(method):
    """A method of an object with `_surface_rank_errors()` (`LLM`) run (a generator: its iteration) so
    that a collective failing because a TP rank died raises that rank's own error text."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def gen(self, *args, **kw):
            with self._surface_rank_errors():
                return (yield from method(self, *args, **kw))

        return gen

    @functools.wraps(method)
    def call(self, *args, **kw):
        with self._surface_rank_errors():
            return method(self, *args, **kw)

    return call


def releasing_ranks_on_failure(init):
    """An `__init__` (of `LLM`: `_ranks`, `_owns_group`) that fails after starting TP ranks kills them
    and destroys the group it made, so the process is
    as before (a retry starts afresh instead of finding a half-made group)."""

    @functools.wraps(init)
    def wrapper(self, *args, **kw):
        try:
            init(self, *args, **kw)
        except BaseException:
            if getattr(self, "_ranks", None) is not None:
                self._ranks.close(kill=True)
            if getattr(self, "_owns_group", False) and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            raise

    return wrapper
