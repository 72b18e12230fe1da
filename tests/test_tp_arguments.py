"""What reaches the tensor-parallel ranks: a caller's own classes (SamplingParams / SpecConfig subclasses,
int / str subclasses, os.PathLike, namedtuples) arrive as k26's or built-in values, and ranks started apart
(torchrun) must share the checkpoints and settings (the rank driver itself: tests/test_tp_driver.py)."""

import os
from enum import Enum

import pytest
import torch

from k26 import LLM, SamplingParams, SpecConfig

KW = {"device": "cpu", "dtype": torch.float32, "progress": False, "max_batch": 1, "max_model_len": 64}


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


class _Count(int):  # (the caller's own classes, as the test above: a rank cannot import this module)
    pass


class _Dir(str):
    pass


class _Reduce(str, Enum):  # (its own __str__ says "_Reduce.FUSED")
    FUSED = "fused"


def test_constructor_values_of_the_callers_own_classes_reach_the_ranks(tiny_tp):
    # (found by a review: an int / str subclass or a namedtuple bucket of the caller's script failed every
    # rank at its start: "Can't get attribute ..."; only os.PathLike paths were converted)
    from collections import namedtuple

    pair = namedtuple("pair", "batch nodes")
    kw = {**KW, "max_batch": 2}
    greedy, spec = SamplingParams(max_tokens=3, stop_token_ids=[]), SpecConfig("ar")
    llm = LLM(tiny_tp[0], drafter=tiny_tp[1], tp=2, **kw)
    try:
        plain = llm.generate([[1, 2, 3]], greedy, spec)[0].token_ids
    finally:
        llm.close()
    mine = {"max_batch": _Count(2), "max_model_len": _Count(64), "prefill_chunk": _Count(4)}
    mine |= {"allreduce": _Reduce.FUSED}
    llm = LLM(tiny_tp[0], drafter=_Dir(tiny_tp[1]), tp=2, **(kw | mine), buckets=[pair(2, 4)])
    try:
        assert llm.generate([[1, 2, 3]], greedy, spec)[0].token_ids == plain
    finally:
        llm.close()


def test_the_checkpoint_digest_tells_drafters_apart_and_copies_alike(tiny_tp, tmp_path):
    # (found by a review: torchrun ranks given different drafters compared only "a drafter or none"; their
    # first step hung in mismatched collectives until the timeout)
    import shutil

    from k26.dist import checkpoint_digest
    from k26.tiny import write_tiny_drafter

    copy = shutil.copytree(tiny_tp[1], tmp_path / "copy")
    other = write_tiny_drafter(tmp_path / "other", tiny_tp[0], layers=2, seed=2, heads=4, kv_heads=4)
    assert checkpoint_digest(copy) == checkpoint_digest(tiny_tp[1]) != checkpoint_digest(other)
    # the same config and index over weight files of another size (say, another export's shards): apart
    shard = min(copy.glob("*.safetensors"))
    with open(shard, "ab") as f:
        f.write(b"\0" * 64)
    assert checkpoint_digest(copy) != checkpoint_digest(tiny_tp[1])


class _CallersSampling(SamplingParams):  # (defined by the caller: the ranks' interpreters do not have it)
    pass


class _CallersSpec(SpecConfig):
    pass


def test_sampling_and_spec_subclasses_of_the_callers_reach_the_ranks(tiny_tp):
    # (found by a review: a rank could not unpickle the caller's own class and died: the LLM was broken)
    llm = LLM(tiny_tp[0], tp=2, **{**KW, "max_batch": 2})
    try:
        plain = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, stop_token_ids=[]), SpecConfig("ar"))
        mine = llm.generate(
            [[1, 2, 3]], _CallersSampling(max_tokens=3, stop_token_ids=[]), _CallersSpec("ar")
        )
        assert mine[0].token_ids == plain[0].token_ids
        llm.open_batch(_CallersSpec(_Dir("ar")))  # (a str subclass in a field too)
        (slot,) = llm.admit([[1, 2, 3]], [_CallersSampling(max_tokens=3, stop_token_ids=[])])
        while llm.batch.live:
            llm.step()
        assert llm.release(slot).token_ids == plain[0].token_ids and llm.broken is None
    finally:
        llm.close()


@pytest.mark.parametrize("differs", ["drafter", "load_cache"])
def test_torchrun_ranks_started_apart_must_share_drafter_and_load_cache(tiny_tp, tmp_path, differs):
    # (found by reviews: the ranks compared only "a drafter or none", and not whether a load cache is used,
    # which has collectives of its own: a hang in mismatched collectives until K26_DIST_TIMEOUT)
    import socket
    import subprocess
    import sys

    from k26.tiny import write_tiny_drafter

    other = write_tiny_drafter(tmp_path / "other", tiny_tp[0], layers=2, seed=2, heads=4, kv_heads=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (
        "import sys, torch\nfrom k26 import LLM\n"
        "LLM(sys.argv[1], drafter=sys.argv[2], tp=2, device='cpu', dtype=torch.float32, progress=False, "
        "max_batch=1, max_model_len=64, cache_dir=sys.argv[3] or None)\n"
    )
    procs = []
    for rank in range(2):
        drafter = other if rank == 1 and differs == "drafter" else tiny_tp[1]
        cache = str(tmp_path / "cache") if rank == 0 and differs == "load_cache" else ""
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "K26_DIST_TIMEOUT": "60",  # (before: a hang until it)
        }
        cmd = [sys.executable, "-c", script, str(tiny_tp[0]), str(drafter), cache]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        procs.append(subprocess.Popen(cmd, env=env, text=True, **pipes))
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode != 0 and f"tensor-parallel ranks were started with different {differs}" in err, (
            err
        )
