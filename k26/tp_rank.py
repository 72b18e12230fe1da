"""A tensor-parallel rank process's side of `tp_driver` (what `_Rank` starts): join the group, build the
object rank 0 builds, then run every call rank 0 mirrors until told to leave; report failures to rank 0
over the message pipe. Tied to rank 0: ignores the terminal's Ctrl-C and dies with its parent.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist

from . import dist as k26_dist

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _report(e: BaseException, rank: int) -> tuple:
    """A rank's failure to build its object, for rank 0: a user's error (a ValueError: a bad checkpoint,
    config or TP size) as itself, to be raised there as rank 0's own would be (its traceback in a note);
    anything else as its traceback."""
    user = e if isinstance(e, ValueError) else None
    if user is not None:
        user.add_note(f"(raised on tensor-parallel rank {rank}; its traceback:)\n{traceback.format_exc()}")
    if user is not None:
        try:
            pickle.loads(pickle.dumps(user))
        except Exception:  # noqa: BLE001  (an exception that does not survive pickling: its text)
            user = None
    return user, traceback.format_exc()


def _serve(init: dict, out) -> int:
    """A rank's life: join, build, then mirror calls until told to stop."""

    def send(*msg) -> None:
        pickle.dump(msg, out)
        out.flush()

    try:
        if not (init["device"] or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
            torch.set_num_threads(init["threads"])  # N ranks on one CPU: share its cores, not oversubscribe
        store = dist.TCPStore(
            "127.0.0.1", init["port"], init["world"], is_master=False, timeout=k26_dist.timeout()
        )
        send("joining", None)
        k26_dist.init_group(init["rank"], init["world"], init["device"], store=store)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # (once per place, as rank 0 shows them)
            obj = init["factory"](*init["args"], **init["kwargs"])
    except BaseException as e:  # noqa: BLE001  (any failure, exits included, is the parent's to raise)
        send("error", _report(e, init["rank"]))
        return 1
    # k26's own warnings go to rank 0 (this rank's stderr is a file read only when it fails)
    send("ready", [str(w.message) for w in caught if w.filename.startswith(_PACKAGE_DIR)])
    while True:
        try:
            msg = pickle.load(sys.stdin.buffer)
        except EOFError:  # the parent is gone
            return 0
        if msg is None:
            break
        name, args, kw = msg
        try:
            result = getattr(obj, name)(*args, **kw)
            if name == "stream":
                for _ in result:
                    pass
        except BaseException:  # noqa: BLE001  out of step with the others: report, leave, break their collectives
            # (rank 0 checked the same call's inputs: any error here is a divergence, never the user's)
            send("error", (None, traceback.format_exc()))
            return 1
        send("done", None)
    if callable(close := getattr(obj, "close", None)):
        close()  # this rank's graphs and fused-collective workspace, before its group goes
    dist.destroy_process_group()
    return 0


def main() -> int:
    out = os.fdopen(os.dup(1), "wb")  # the message pipe; prints from here on go to stderr, not into it
    os.dup2(2, 1)
    try:
        init = pickle.load(sys.stdin.buffer)
    except BaseException:  # noqa: BLE001  (any failure, exits included, is the parent's to raise)
        # (no exception object: it may be what did not unpickle; `raise_failure` wants (error, text))
        pickle.dump(("error", (None, traceback.format_exc())), out)
        out.flush()
        return 1
    return _serve(init, out)


def _tied_to_parent() -> None:
    """Rank 0 drives: a rank ignores the terminal's Ctrl-C (rank 0 ends its calls and tells it to leave, or
    kills it) and dies with rank 0, even before it has joined (a rank waiting for the rendezvous reads no
    pipe and would outlive a killed parent for the whole timeout). A watcher thread, not prctl's
    PR_SET_PDEATHSIG: that fires when the *thread* that started the rank ends (an LLM built in a worker
    thread lost its ranks at once)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.environ.get("K26_PARENT_PID")
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):  # (reparented once the parent is gone)
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="k26-parent-watch").start()


def run_rank() -> None:
    """A rank process's whole life (what `_Rank` starts): `main`, then exit without the interpreter's teardown
    (module and tensor finalisation, ~0.5 s of CPU per rank): the parent waits for every rank to exit, and
    there is nothing left to save. Messages are flushed."""
    _tied_to_parent()
    code = main()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_rank()
