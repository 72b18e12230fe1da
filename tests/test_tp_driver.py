"""The rank driver of `LLM(tp=N)`: a rank that fails before or after joining fails the parent within seconds
with that rank's own error (a script on stdin driving TP 2: tests/test_tp.py)."""

import time

import pytest
import torch
import torch.distributed as dist

from k26 import LLM, SamplingParams, SpecConfig
from k26.tp_driver import RankError

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


def test_an_admit_the_open_batch_refuses_leaves_a_tp_llm_working(tiny_tp):
    # (found by a review: the batch's own refusal, logprobs without logprobs graphs, came on every rank after
    # the call was mirrored; a rank's error on a mirrored call means "out of step": the LLM was broken)
    from k26 import SamplingParams, SpecConfig

    llm = LLM(tiny_tp[0], tp=2, **{**KW, "max_batch": 2})
    try:
        llm.open_batch(SpecConfig("ar"), logprobs=False)
        with pytest.raises(ValueError, match="this batch has no logprobs graphs"):
            llm.admit([[5, 6, 7]], [SamplingParams(max_tokens=3, logprobs=1)])
        (slot,) = llm.admit([[5, 6, 7]], [SamplingParams(max_tokens=3, stop_token_ids=[])])
        while llm.batch.live:
            llm.step()
        assert len(llm.release(slot).token_ids) == 3 and llm.broken is None
    finally:
        llm.close()


def test_a_call_refused_at_the_mirror_leaves_the_open_batchs_prefixes(tiny_tp, monkeypatch):
    # (found by a review: generate() forgot the open batch's prefixes on rank 0 before its argument was
    # refused at the mirror; the ranks still held them, and the next admit prefilled other positions on rank 0
    # than on rank 1: mismatched collectives, rank 1 killed by SIGABRT)
    llm = LLM(tiny_tp[0], tp=2, **{**KW, "max_batch": 2})
    greedy = SamplingParams(max_tokens=2, stop_token_ids=[])
    try:
        llm.open_batch(SpecConfig("ar"))
        prompt = list(range(1, 41))
        (slot,) = llm.admit([prompt], [greedy])
        while llm.batch.live:
            llm.step()
        llm.release(slot)
        mirror = llm._ranks.mirror

        def refuse(name, *args, **kw):
            raise TypeError(f"{name}(): an argument cannot be sent to the tensor-parallel ranks")

        monkeypatch.setattr(llm._ranks, "mirror", refuse)
        with pytest.raises(TypeError, match="cannot be sent"):
            llm.generate([[1, 2, 3]], greedy)
        monkeypatch.setattr(llm._ranks, "mirror", mirror)
        (slot,) = llm.admit([[*prompt, 7]], [greedy])
        while llm.batch.live:
            llm.step()
        assert llm.release(slot).cached_tokens == 40 and llm.broken is None
    finally:
        llm.close()


def test_a_batch_no_graph_bucket_holds_is_refused_before_the_ranks_are_told(tiny_tp, monkeypatch):
    # (found by a review: the decoder's pick_bucket refused it on every rank, after the call was mirrored;
    # graphs need CUDA, so rank 0 alone is told it has them: its check must come before anything is sent)
    llm = LLM(tiny_tp[0], drafter=tiny_tp[1], tp=2, **{**KW, "max_batch": 2}, buckets=[(1, 1)])
    try:
        told: list[str] = []
        mirror = llm._ranks.mirror
        monkeypatch.setattr(
            llm._ranks, "mirror", lambda name, *a, **k: (told.append(name), mirror(name, *a, **k))
        )
        monkeypatch.setattr(llm, "graphs", True)
        greedy = SamplingParams(max_tokens=2, stop_token_ids=[])
        for call in (
            lambda: llm.generate([[1, 2], [3, 4]], greedy, SpecConfig("ar")),
            lambda: llm.open_batch(SpecConfig("ar"), capacity=2),
            lambda: llm.generate([[1, 2]], greedy, SpecConfig("dflash")),
        ):
            with pytest.raises(ValueError, match="no graph bucket holds batch"):
                call()
        assert told == []
        monkeypatch.setattr(llm, "graphs", False)
        assert len(llm.generate([[1, 2], [3, 4]], greedy, SpecConfig("ar"))) == 2 and llm.broken is None
    finally:
        llm.close()
