"""The rank driver of `LLM(tp=N)`: a rank that fails before or after joining fails the parent within seconds
with that rank's own error (a script on stdin driving TP 2: tests/test_tp.py)."""

import time

import pytest
import torch
import torch.distributed as dist

from k26 import LLM
from k26.tp_driver import RankError, RankGroup

KW = {"device": "cpu", "dtype": torch.float32, "progress": False, "max_batch": 1, "max_model_len": 64}


def test_a_rank_killed_before_joining_fails_the_parent_fast(tiny_tp, tmp_path, monkeypatch):
    # A sitecustomize on the ranks' path runs at their interpreter's start: the rank says why, then dies by
    # SIGKILL before it can join (this process started long ago and does not run it).
    (tmp_path / "sitecustomize.py").write_text(
        "import os, signal, sys\nsys.stderr.write('rank cannot start: out of file handles\\n')\n"
        "sys.stderr.flush()\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 failed: killed by SIGKILL.*out of file handles"):
        LLM(tiny_tp[0], tp=2, **KW)
    assert time.monotonic() - t0 < 10
    assert not dist.is_initialized()


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


def test_a_broken_checkpoint_under_tp_raises_its_own_error_every_time(tiny_tp, tmp_path):
    """Rank 0 and rank 1 find the same bad shard; whichever reports first, the caller gets the
    CheckpointError (it was a RankError carrying a traceback when rank 1 won the race)."""
    import shutil

    from k26 import CheckpointError

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_tp[0], d)
    shard = max(d.glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    for _ in range(2):
        with pytest.raises(CheckpointError, match="is corrupt"):
            LLM(d, tp=2, **KW)
        assert not dist.is_initialized()


def test_a_tp_size_the_pair_cannot_split_is_refused_before_any_rank_or_weight(tiny_tp, tmp_path, monkeypatch):
    import k26.engine

    def no_load(*a, **kw):
        raise AssertionError("weights read before the TP size was checked")

    monkeypatch.setattr(k26.engine, "load_model", no_load)
    monkeypatch.setattr(k26.engine.LLM, "_start_ranks", no_load)
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide"):
        LLM(tiny_tp[0], tp=3, **KW)
    from k26.tiny import write_tiny_drafter

    two_kv = write_tiny_drafter(tmp_path / "d", tiny_tp[0], layers=1, seed=2, heads=4, kv_heads=2)
    with pytest.raises(
        ValueError, match="drafter num_key_value_heads=2 is not divisible by the tensor-parallel size 4"
    ):
        LLM(tiny_tp[0], drafter=two_kv, tp=4, **KW)


def test_a_rank_killed_after_joining_fails_the_parent_fast(tiny_tp):
    llm = LLM(tiny_tp[0], tp=2, **KW)
    try:
        llm._ranks.ranks[0].proc.kill()
        t0 = time.monotonic()
        with pytest.raises(RankError, match="rank 1 failed: killed by SIGKILL"):
            llm.score([1, 2, 3])
        assert time.monotonic() - t0 < 10
        # every later call names the dead rank (it said "rank 0 left score() on RuntimeError ... out of step",
        # then nested its own refusals)
        why = llm.broken
        assert why.startswith("its tensor-parallel ranks failed (rank 1: killed by SIGKILL")
        assert why.endswith("); close() it and make a new LLM") and "out of step" not in why
        for _ in range(2):
            with pytest.raises(RankError) as e:
                llm.generate([1, 2, 3])
            assert str(e.value) == "this LLM's " + why.removeprefix("its ")
    finally:
        llm.close()
    assert not dist.is_initialized()


def test_a_bad_input_under_tp_raises_at_once(tiny_tp):
    """Input errors are raised before any rank is asked, without waiting for a rank failure."""
    llm = LLM(tiny_tp[0], tp=2, **KW)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.score([1, 10**9])
        assert time.monotonic() - t0 < 1.0
        assert llm.score([1, 2, 3]).shape[0] == 3  # the ranks are still in step
    finally:
        llm.close()


def test_a_failed_tp_init_leaves_no_group_and_no_rank(tiny_tp):
    """An LLM(tp=2) whose own checks fail after its ranks started kills them and destroys its group: the
    next LLM(tp=2) in the same process starts afresh. (graphs=True on a CPU: checked once the device is
    known, after the ranks start; the config checks now all run before.)"""
    with pytest.raises(ValueError, match="graphs=True needs a CUDA device"):
        LLM(tiny_tp[0], tp=2, **{**KW, "graphs": True})
    assert not dist.is_initialized()
    llm = LLM(tiny_tp[0], tp=2, **KW)
    try:
        assert llm.score([1, 2, 3]).shape[0] == 3
    finally:
        llm.close()


def test_an_llm_dropped_without_close_leaves_the_next_tp_llm_working(tiny_tp, monkeypatch):
    """An LLM(tp=2) dropped without close() (unreachable in a reference cycle until collected; collected,
    its finalizer stops its ranks): the next LLM(tp=2) starts its own ranks. It found the old group and
    paired its collectives with ranks that had left or that served the old LLM (a gloo error after the
    group's timeout). One still live (`llm = LLM(tp=2)` again: the old one is bound while the new one is
    built) is named at once."""
    monkeypatch.setenv("K26_DIST_TIMEOUT", "10")  # (before the fix: the hang, bounded)
    llm = LLM(tiny_tp[0], tp=2, **KW)
    del llm
    llm = LLM(tiny_tp[0], tp=2, **KW)
    try:
        assert llm.score([1, 2, 3]).shape[0] == 3
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"another LLM\(tp=2\) of this process .* close\(\) it"):
            LLM(tiny_tp[0], tp=2, **KW)
        assert time.monotonic() - t0 < 5
        assert llm.score([1, 2, 3]).shape[0] == 3
    finally:
        llm.close()
    assert not dist.is_initialized()


def test_a_call_rank_0_left_midway_is_named_and_close_does_not_wait_for_its_ranks(tiny_tp, monkeypatch):
    """Ctrl-C (a KeyboardInterrupt on rank 0 alone: a notebook's interrupt, `kill -INT`) during generate():
    the ranks run on, waiting in its collectives. The next call is refused by name (it paired its
    collectives with that call's leftovers: a gloo error after the group's timeout) and close() kills
    them at once (it waited 60 s for ranks that never read its request to leave)."""
    from k26 import SamplingParams

    monkeypatch.setenv("K26_DIST_TIMEOUT", "10")  # (before the fix: the next call's hang, bounded)
    llm = LLM(tiny_tp[0], tp=2, **KW)
    run = llm.decoder.run

    def interrupted(*a, **kw):
        steps = run(*a, **kw)
        yield next(steps)
        raise KeyboardInterrupt

    try:
        monkeypatch.setattr(llm.decoder, "run", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=40, stop_token_ids=[]))
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"out of step: rank 0 left generate\(\) on KeyboardInterrupt"):
            llm.score([1, 2, 3])
        assert time.monotonic() - t0 < 1
    finally:
        t0 = time.monotonic()
        llm.close()
    assert time.monotonic() - t0 < 5
    assert all(r.proc.poll() is not None for r in llm._ranks.ranks)


def test_closing_with_a_stream_suspended_does_not_wait_for_its_ranks(tiny_tp):
    """A stream() left suspended at close() (or at exit: the finalizer): its ranks run it on, waiting in its
    collectives. close() waited 60 s before killing them; then the generator, closed later, drained its
    steps against the dead ranks and raised 'seek of closed file' from the closed rank log."""
    import gc

    from k26 import SamplingParams

    llm = LLM(tiny_tp[0], tp=2, **KW)
    pieces = llm.stream([1, 2, 3], SamplingParams(max_tokens=40, stop_token_ids=[], min_tokens=40))
    next(pieces)
    t0 = time.monotonic()
    llm.close()
    assert time.monotonic() - t0 < 5
    assert all(r.proc.poll() is not None for r in llm._ranks.ranks)
    pieces.close()  # no drain against ranks that are gone
    del pieces
    gc.collect()


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


def test_a_rank_late_past_the_dist_timeout_names_it(tiny_tp, monkeypatch):
    """A K26_DIST_TIMEOUT shorter than a rank's start (its interpreter and torch: seconds) said only "sent no
    'joining' in time" (found in a bug hunt)."""
    monkeypatch.setenv("K26_DIST_TIMEOUT", "0.2")
    with pytest.raises(RankError, match=r"rank 1 sent no 'joining' within 0.2 s \(K26_DIST_TIMEOUT\)"):
        LLM(tiny_tp[0], tp=2, **KW)


def test_a_tp_llm_beside_an_open_one_of_another_size_is_told_the_remedy(tiny_tp):
    """(Found in a bug hunt: 'tp=1 but the initialised process group has 2 ranks', no way out said.)"""
    llm = LLM(tiny_tp[0], tp=2, **KW)
    try:
        with pytest.raises(ValueError, match="has 2 ranks .*: close that LLM first, or give this one"):
            LLM(tiny_tp[0], tp=1, **KW)
    finally:
        llm.close()


def test_a_spec_capture_cannot_serve_is_refused_before_the_ranks_are_asked(tiny_tp):
    """(Found in a bug hunt: capture() mirrored the call to the ranks before checking its spec, so a spec the
    LLM cannot serve — DFlash without a drafter — raised on rank 0 after the ranks had run the call, and every
    later call was refused as out of step.) Only this process takes the graphs path here: on the CPU the
    ranks have no graphs and return at once, as a rank whose capture succeeded does."""
    from k26 import SamplingParams, SpecConfig

    llm = LLM(tiny_tp[0], tp=2, **KW)
    try:
        llm.graphs = True
        with pytest.raises(ValueError, match="drafter"):
            llm.capture(SpecConfig("dflash"))
        llm.graphs = False
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop_token_ids=[]))
        assert len(out[0].token_ids) == 2
    finally:
        llm.close()


def test_a_closed_pipe_under_tp_stops_the_stream_instead_of_finishing_it(tiny_tp, monkeypatch):
    """`python -m k26 generate --tp 2 ... | head -c 3`: the BrokenPipeError left the suspended stream to be
    collected, whose GeneratorExit branch runs the mirrored stream to --max-tokens so the ranks stay in step
    (found in a bug hunt: 26 s for 300 tokens of the tiny pair before exit 141; minutes on a real model).
    Closing the LLM first marks its ranks gone, and the stream stops at once."""
    import io

    import k26.__main__ as cli
    from k26.decode import Decoder

    steps, run = [], Decoder.run

    def counted(self, *a, **kw):
        for out in run(self, *a, **kw):
            steps.append(1)
            yield out

    class ClosedPipe(io.StringIO):
        def write(self, s):
            if s and self.tell() > 0:
                raise BrokenPipeError
            return super().write(s)

    monkeypatch.setattr(Decoder, "run", counted)
    monkeypatch.setattr("sys.stdout", ClosedPipe())
    argv = ["generate", "--model", str(tiny_tp[0]), "--tp", "2", "--device", "cpu", "--dtype", "fp32"]
    assert cli.main([*argv, "--prompt", "hello", "--max-tokens", "300", "--max-model-len", "400"]) == 141
    assert 0 < len(steps) < 20


def test_ranks_given_different_checkpoints_or_settings_are_a_named_user_error(tiny_tp, monkeypatch):
    """torchrun with another --model on one rank: the digests differ. (Found in a bug hunt: a RuntimeError,
    which `python -m k26` re-raised as a traceback on every rank; a ValueError is its one-line exit 2.) With
    another --max-model-len on one rank (found by a TP review: unnoticed, the ranks' collectives diverge)."""
    from k26 import dist as k26_dist

    other: list = []  # what rank 1 says: (digest, settings)

    def gather(out, mine):
        out[:] = [mine, other[0](mine)]

    monkeypatch.setattr(k26_dist.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(k26_dist.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(k26_dist.dist, "all_gather_object", gather)
    settings = {"max_model_len": 512, "max_batch": 8}
    other.append(lambda mine: ("another", mine[1]))
    with pytest.raises(ValueError, match=r"ranks loaded different checkpoints .* rank 0 has .*"):
        k26_dist.same_setup_on_every_rank(tiny_tp[0], settings)
    other[0] = lambda mine: mine
    k26_dist.same_setup_on_every_rank(tiny_tp[0], settings)  # alike: no error
    other[0] = lambda mine: (mine[0], mine[1] | {"max_model_len": 4096})
    with pytest.raises(
        ValueError, match=r"started with different max_model_len: \[512, 4096\] \(rank by rank\)"
    ):
        k26_dist.same_setup_on_every_rank(tiny_tp[0], settings)


class _CachePath:
    """A caller's own os.PathLike: its class lives in this test module, which a rank cannot import."""

    def __init__(self, path):
        self.path = str(path)

    def __fspath__(self):
        return self.path


def test_a_path_like_of_the_callers_own_class_reaches_the_ranks(tiny_tp, tmp_path):
    """(Found in a bug hunt: cache_dir=<a custom os.PathLike> under tp=2 failed on the ranks with a pickling
    error ("Can't get attribute ..."), raised as a RankError carrying a rank's traceback.)"""
    from k26 import SamplingParams

    llm = LLM(tiny_tp[0], tp=2, cache_dir=_CachePath(tmp_path / "cache"), **KW)
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop_token_ids=[]))
        assert len(out[0].token_ids) == 2
    finally:
        llm.close()


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
