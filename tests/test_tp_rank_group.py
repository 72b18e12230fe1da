"""The rank group under `LLM(tp=N)` (k26/tp_driver.py RankGroup, k26/tp_rank.py) driven directly: a
rank's failure after joining, its start message and stderr, arguments no rank can take, a broken group, the
ranks' signals, their warnings and their parent (the LLM's view of the same failures:
tests/test_tp_driver.py)."""

import time

import pytest
import torch
import torch.distributed as dist

from k26.tp_driver import RankError, RankGroup


@pytest.mark.parametrize("user", [True, False], ids=["user-error", "bug"])
def test_a_rank_failing_after_joining_fails_the_parent_fast(tmp_path, user):
    """The rank joins the group, then fails to build its object: a user's error (a ValueError: here the
    config of a missing checkpoint) reaches the parent as itself, anything else as the rank's traceback."""
    from k26.config import ConfigError, ModelConfig

    factory = ModelConfig.from_dir if user else torch.device  # (torch.device("...nowhere"): RuntimeError)
    group = RankGroup(2, factory, (str(tmp_path / "nowhere"),), {}, "cpu")
    t0 = time.monotonic()  # joined: from here the rank's failure must reach this process within 10 s
    try:
        assert dist.is_initialized() and dist.get_world_size() == 2
        expected = (ConfigError, "nowhere") if user else (RankError, r"(?s)rank 1 failed: Traceback.*nowhere")
        with pytest.raises(expected[0], match=expected[1]):
            group.wait_ready()
        assert time.monotonic() - t0 < 10
    finally:
        group.close()
        dist.destroy_process_group()


def test_a_start_message_a_rank_cannot_read_reaches_the_parent_as_its_traceback():
    """(Found in a bug hunt: the rank sent the bare traceback text, which the parent took as (error, text) and
    raised its first letter — "exceptions must derive from BaseException" — losing the rank's error.)"""
    import pickle
    import subprocess
    import sys

    from k26.tp_driver import RankError, _Rank

    cmd = [sys.executable, "-m", "k26.tp_rank"]
    p = subprocess.run(cmd, check=False, input=b"no pickle", capture_output=True, timeout=120)
    kind, payload = pickle.loads(p.stdout)
    assert kind == "error" and payload[0] is None and "UnpicklingError" in payload[1]
    rank = object.__new__(_Rank)  # (only its number is read when it reports a failure it was sent)
    rank.rank = 1
    with pytest.raises(RankError, match="(?s)tensor-parallel rank 1 failed: .*UnpicklingError"):
        rank.raise_failure(kind, payload)


def test_a_rank_says_nothing_on_stderr_while_it_works(tmp_path):
    """Started with `python -m k26.tp_driver`, every rank's stderr — the tail a RankError quotes — began with
    runpy's RuntimeWarning that the module was "found in sys.modules" (found in a bug hunt)."""
    group = RankGroup(2, dict, (), {}, "cpu")
    try:
        group.wait_ready()
        log = group.ranks[0].log
        log.seek(0)
        assert log.read() == b""
    finally:
        group.close()
        dist.destroy_process_group()


def _idle_soon(group: RankGroup, within: float = 30.0) -> bool:
    """Whether every rank finishes the calls mirrored to it within `within` seconds."""
    deadline = time.monotonic() + within
    while not group._idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    return group._idle()


def test_an_argument_no_rank_can_take_is_named_and_leaves_the_ranks_in_step():
    # (a local class in a call's arguments: the pickle failed after rank 0 had counted the call as sent: the
    # user saw "'RankGroup' object has no attribute '_last'" and every close() waited, then killed the ranks)
    class Local:
        pass

    group = RankGroup(2, dict, (), {}, "cpu")
    try:
        group.wait_ready()
        with pytest.raises(
            TypeError, match=r"update\(\): an argument cannot be sent to the tensor-parallel ranks"
        ):
            group.mirror("update", {"x": Local()})
        group.mirror("update", {"x": 1})
        assert _idle_soon(group) and group.broken is None
    finally:
        group.close()
        dist.destroy_process_group()


def test_a_failed_rank_is_named_by_every_later_call_and_breaks_the_group():
    # (after a rank died, later calls said "rank 0 left generate() on RuntimeError while the other ranks ran
    # it", and a server's engine stepped the broken group forever while /health said ok)
    group = RankGroup(2, dict, (), {}, "cpu")
    try:
        group.wait_ready()
        with pytest.raises(RankError), group.surface():
            group.mirror("update", {"x": 1})
            raise RankError(  # (as _Rank.raise_failure makes it)
                "tensor-parallel rank 1 failed: killed by SIGKILL; its stderr ends:\nTraceback ...",
                "rank 1: killed by SIGKILL",
            )
        assert group.broken == "failed (rank 1: killed by SIGKILL); close() it and make a new LLM"
        with pytest.raises(RankError, match=r"ranks failed \(rank 1: killed by SIGKILL\); close\(\) it"):
            group.mirror("update", {"x": 2})
    finally:
        group.close(kill=True)
        dist.destroy_process_group()


def test_a_rank_ignores_the_terminals_ctrl_c_and_dies_with_its_parent(tmp_path):
    """Ctrl-C at a terminal reaches every process of its group: ranks died mid-step, and a server's clients
    got rank 1's traceback instead of the shutdown's 503. A rank whose parent died before it joined waited
    in the rendezvous for the whole timeout (minutes), an orphan."""
    import os
    import signal
    import subprocess
    import sys

    group = RankGroup(2, dict, (), {}, "cpu")
    try:
        group.wait_ready()
        os.kill(group.ranks[0].proc.pid, signal.SIGINT)
        time.sleep(1.0)
        assert group.ranks[0].proc.poll() is None
    finally:
        group.close()
        dist.destroy_process_group()
    # a parent that starts a rank, tells it to join a rendezvous nobody serves, then dies by SIGKILL
    script = (
        "import socket, sys, time\nfrom k26.tp_driver import _Rank\nr = _Rank(1)\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]\n"
        "r.send({'rank': 1, 'world': 2, 'port': port, 'device': 'cpu', 'threads': 1, 'factory': dict, "
        "'args': (), 'kwargs': {}})\nprint(r.proc.pid, flush=True)\ntime.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    rank_pid = int(parent.stdout.readline())
    time.sleep(1.0)  # (the rank is in the rendezvous now)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(rank_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(rank_pid, signal.SIGKILL)
        pytest.fail("the rank outlived its parent")


def test_k26s_warnings_on_a_rank_while_it_builds_are_warned_on_rank_0():
    # (a rank's load cache it could not write warned into the rank's private stderr file only: every start
    # re-read the whole checkpoint without a word; rank 0's own said "k26: warning: load cache ..."
    import warnings

    group = RankGroup(2, warnings.warn, ("load cache D not written (EISDIR)",), {}, "cpu")
    try:
        with pytest.warns(UserWarning, match=r"tensor-parallel rank 1: load cache D not written \(EISDIR\)"):
            group.wait_ready()
    finally:
        group.close()
        dist.destroy_process_group()


def test_ranks_started_from_a_thread_outlive_that_thread():
    # (prctl's PR_SET_PDEATHSIG, tried first, killed the ranks when the thread that built the LLM ended: an
    # LLM(tp=N) built in a worker thread lost its ranks at once)
    import threading

    made: list = []
    t = threading.Thread(target=lambda: made.append(RankGroup(2, dict, (), {}, "cpu")))
    t.start()
    t.join(120)
    group = made[0]
    try:
        group.wait_ready()
        time.sleep(1.5)  # (the parent watcher looks twice a second)
        assert group.ranks[0].proc.poll() is None
        group.mirror("update", {"x": 1})
        assert _idle_soon(group) and group.ranks[0].proc.poll() is None
    finally:
        group.close()
        dist.destroy_process_group()
