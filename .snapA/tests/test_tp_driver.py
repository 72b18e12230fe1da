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


def test_a_rank_failing_after_joining_fails_the_parent_fast(tmp_path):
    """The rank joins the group, then fails to build its object: its own exception reaches the parent."""
    from k26.config import ModelConfig

    group = RankGroup(2, ModelConfig.from_dir, (str(tmp_path / "nowhere"),), {}, "cpu")
    t0 = time.monotonic()  # joined: from here the rank's failure must reach this process within 10 s
    try:
        assert dist.is_initialized() and dist.get_world_size() == 2
        with pytest.raises(RankError, match=r"(?s)rank 1 failed: Traceback.*nowhere"):
            group.wait_ready()
        assert time.monotonic() - t0 < 10
    finally:
        group.close()
        dist.destroy_process_group()


def test_a_rank_killed_after_joining_fails_the_parent_fast(tiny_tp):
    llm = LLM(tiny_tp[0], tp=2, **KW)
    try:
        llm._ranks.ranks[0].proc.kill()
        t0 = time.monotonic()
        with pytest.raises(RankError, match="rank 1 failed: killed by SIGKILL"):
            llm.score([1, 2, 3])
        assert time.monotonic() - t0 < 10
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
    next LLM(tp=2) in the same process starts afresh."""
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_tp[0], tp=2, **{**KW, "max_model_len": 10**9})
    assert not dist.is_initialized()
    llm = LLM(tiny_tp[0], tp=2, **KW)
    try:
        assert llm.score([1, 2, 3]).shape[0] == 3
    finally:
        llm.close()
