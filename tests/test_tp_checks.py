"""What LLM(tp=N) and the CLI check before any rank process starts: the TP size against the visible GPUs and
torchrun's world, a device index, K26_DIST_TIMEOUT, torchrun's RANK, and a torchrun group's failures as one
line (the rank driver itself: tests/test_tp_driver.py)."""

import pytest
import torch

from k26 import LLM

KW = {"device": "cpu", "dtype": torch.float32, "progress": False, "max_batch": 1, "max_model_len": 64}


def gpus_but_no_rank(monkeypatch, count: int, why: str) -> None:
    """`count` visible CUDA devices, no torchrun, and a failure (`why`) if LLM starts a rank process."""
    import k26.engine

    def no_rank(*a, **kw):
        raise AssertionError(why)

    monkeypatch.setattr(k26.engine.LLM, "_start_ranks", no_rank)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_a_tp_size_above_the_visible_gpus_is_refused_before_any_rank(tiny_tp, monkeypatch, capsys):
    """tp=4 with 2 GPUs: named before any rank starts (ranks 2 and 3 failed on torch.cuda.set_device, each
    a RankError with a traceback, after every process had started)."""
    from k26.__main__ import main

    gpus_but_no_rank(monkeypatch, 2, "a rank started before the TP size was checked against the GPUs")
    for device in (None, "cuda"):
        with pytest.raises(ValueError, match=r"tp=4: only 2 CUDA device\(s\) are visible"):
            LLM(tiny_tp[0], tp=4, **{**KW, "device": device})
    assert main(["generate", "--model", str(tiny_tp[0]), "--prompt", "hi", "--tp", "4"]) == 2
    assert "tp=4: only 2 CUDA device(s)" in capsys.readouterr().err


def test_an_indexed_cuda_device_with_tp_is_refused_before_any_rank(tiny_tp, monkeypatch):
    """LLM(tp=2, device='cuda:1') put rank 0 on cuda:0 all the same (rank r on cuda:r): the index is named.
    (The CLI's --device takes 'cpu' or 'cuda' only.)"""
    gpus_but_no_rank(monkeypatch, 4, "a rank started with a device index no rank honours")
    with pytest.raises(ValueError, match=r"device='cuda:1' with tp=2: rank r runs on cuda:r"):
        LLM(tiny_tp[0], tp=2, **{**KW, "device": "cuda:1"})


def test_under_torchrun_a_ranks_own_cuda_index_is_accepted_and_another_refused(monkeypatch):
    """A torchrun script passing device=f'cuda:{LOCAL_RANK}' ran before the index check: it still does."""
    from k26.checks import check_gpus

    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    check_gpus("cuda:1", 2)
    with pytest.raises(ValueError, match=r"device=.cuda:0. with tp=2: this rank runs on cuda:1 \(LOCAL"):
        check_gpus("cuda:0", 2)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf"])
def test_a_bad_dist_timeout_is_named_before_any_rank(tiny_tp, monkeypatch, capsys, value):
    """K26_DIST_TIMEOUT='abc' was float()'s traceback; 0, -5 or inf broke the group (timeouts, overflow)."""
    from k26.__main__ import main

    monkeypatch.setenv("K26_DIST_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"K26_DIST_TIMEOUT='{value}' in the environment: expected a number"):
        LLM(tiny_tp[0], tp=2, **KW)
    args = ["generate", "--model", str(tiny_tp[0]), "--prompt", "hi", "--tp", "2", "--device", "cpu"]
    assert main(args) == 2
    assert f"K26_DIST_TIMEOUT='{value}'" in capsys.readouterr().err


def test_a_tp_size_other_than_torchruns_world_size_one_is_named(tiny_tp, monkeypatch, capsys):
    """torchrun --nproc-per-node 1 with tp=2 started no rank and built no group: torch's "Default process
    group has not been initialized" (found in a bug hunt)."""
    from k26.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="tp=2 differs from torchrun's WORLD_SIZE 1"):
        LLM(tiny_tp[0], tp=2, **KW)
    args = ["generate", "--model", str(tiny_tp[0]), "--prompt", "hi", "--tp", "2", "--device", "cpu"]
    assert main(args) == 2
    assert "--tp 2 differs from torchrun's WORLD_SIZE 1" in capsys.readouterr().err


def test_torchrun_group_failures_are_one_line_and_a_rank_beyond_the_world_is_named(monkeypatch, capsys):
    """(Found in a bug hunt: under torchrun a peer that never joined, one killed mid-run, or a RANK at or
    beyond WORLD_SIZE ended in a torch traceback.)"""
    import torch.distributed as dist

    import k26
    from k26.__main__ import main
    from k26.dist import group_failure, rank_and_world

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match="RANK=5 in the environment: expected below WORLD_SIZE=2"):
        rank_and_world()
    monkeypatch.setenv("RANK", "0")
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29500\nmore")
    assert group_failure(gone).startswith("the tensor-parallel group failed (torchrun rank 0 of 2): [gloo")
    assert group_failure(RuntimeError("a bug of ours")) is None  # (not taken for a peer's failure)
    late = dist.DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined.")

    def llm(*a, **kw):
        raise late

    monkeypatch.setattr(k26, "LLM", llm)
    monkeypatch.setenv("WORLD_SIZE", "1")  # (generate's own checks: one process; the failure is the LLM's)
    assert main(["generate", "--prompt", "hi", "--spec", "ar", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "1/2 clients joined. (K26_DIST_TIMEOUT" in err and len(err.strip().splitlines()) == 1
