"""The Python API's calls as a program makes them: one call at a time per LLM (another thread's call while
one runs is refused by name, not run on the same cache rows), none after close(), stream() checking its
arguments at the call, an open batch's unfinished rows kept from a new open_batch(), and inputs that were
quietly reinterpreted (float ids as prompts, a memoryview's bytes, a dict's keys as stops) named."""

import threading
import time

import pytest
import torch

import k26
from k26 import LLM, SamplingParams, SpecConfig


@pytest.fixture
def llm(tiny_k25):
    m = LLM(tiny_k25, device="cpu", dtype=torch.float32, progress=False, max_model_len=64, max_batch=2)
    yield m
    m.close()


def hold_decoding(llm, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The next decoding call on `llm` sets `inside`, then waits for `go_on` before it decodes: a call held
    running in its thread while the test acts from another."""
    inside, go_on = threading.Event(), threading.Event()
    run = llm.decoder.run

    def held(*a, **kw):
        inside.set()
        assert go_on.wait(30)
        yield from run(*a, **kw)

    monkeypatch.setattr(llm.decoder, "run", held)
    return inside, go_on


def test_a_call_from_another_thread_while_one_runs_is_refused_by_name(llm, monkeypatch):
    # (four threads' generate() calls each returned plausible tokens, none its own)
    inside, go_on = hold_decoding(llm, monkeypatch)
    sp = SamplingParams(max_tokens=3)
    first: list = []
    t = threading.Thread(target=lambda: first.append(llm.generate([5, 6, 7], sp, SpecConfig("ar"))))
    t.start()
    try:
        assert inside.wait(30)
        for call in (lambda: llm.generate([1, 2], sp), lambda: llm.score([1, 2]), lambda: llm.open_batch()):
            with pytest.raises(RuntimeError, match=r"generate\(\) is running on this LLM in another thread"):
                call()
    finally:
        go_on.set()
        t.join(30)
    monkeypatch.undo()
    assert first and first[0][0].token_ids == llm.generate([5, 6, 7], sp, SpecConfig("ar"))[0].token_ids


def test_close_waits_for_a_call_running_in_another_thread(llm, monkeypatch):
    # (close() from another thread returned at once, freeing graphs under the running call's replay)
    inside, go_on = hold_decoding(llm, monkeypatch)
    out: list = []
    sp = SamplingParams(max_tokens=3)
    caller = threading.Thread(target=lambda: out.append(llm.generate([5, 6, 7], sp)))
    caller.start()
    assert inside.wait(30)
    closer = threading.Thread(target=llm.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # waiting: nothing is torn down under the call
    go_on.set()
    caller.join(30)
    closer.join(30)
    assert not closer.is_alive() and len(out[0][0].token_ids) == 3
    with pytest.raises(RuntimeError, match=r"LLM.generate\(\): this LLM is closed"):
        llm.generate([1, 2])


def test_close_with_a_wait_gives_up_on_a_running_call(llm, monkeypatch):
    # (the server's Ctrl-C during a start-up capture: its close must not wait minutes for the engine thread)
    inside, go_on = hold_decoding(llm, monkeypatch)
    caller = threading.Thread(target=lambda: llm.generate([5, 6, 7], SamplingParams(max_tokens=2)))
    caller.start()
    try:
        assert inside.wait(30)
        t0 = time.monotonic()
        llm.close(wait=0.3)
        assert 0.25 <= time.monotonic() - t0 < 10
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            llm.score([1, 2])
    finally:
        go_on.set()
        caller.join(30)


def test_a_call_racing_close_is_told_the_llm_is_closed(llm):
    # (a call that found the guard held by close() said "LLM.None is running on this LLM in another thread")
    said: list[str] = []
    started = threading.Event()

    def calls():
        while True:
            try:
                started.set()
                llm.score([1, 2])
            except RuntimeError as e:
                said.append(str(e))
                return

    t = threading.Thread(target=calls)
    t.start()
    assert started.wait(30)
    time.sleep(0.05)
    llm.close()
    t.join(30)
    assert len(said) == 1 and "this LLM is closed" in said[0], said


def test_every_call_after_close_is_refused(llm):
    # (a closed single-process LLM went on decoding; with TP ranks it said the ranks were closed)
    llm.close()
    for name, call in [
        ("generate", lambda: llm.generate([1, 2])),
        ("score", lambda: llm.score([1, 2])),
        ("stream", lambda: llm.stream([1, 2])),
        ("open_batch", lambda: llm.open_batch()),
    ]:
        with pytest.raises(RuntimeError, match=rf"LLM.{name}\(\): this LLM is closed"):
            call()


@pytest.mark.parametrize(
    "args, error, needle",
    [
        ((None,), TypeError, "prompts is None"),
        ((["a", "b"],), ValueError, "stream\\(\\) takes one prompt, got 2"),
        (("a", {}), TypeError, "SamplingParams"),
    ],
)
def test_stream_checks_its_arguments_at_the_call_not_at_the_first_next(llm, args, error, needle):
    with pytest.raises(error, match=needle):
        llm.stream(*args)


def test_a_stream_decodes_as_generate_does_and_a_call_between_its_steps_is_refused(llm):
    sp = SamplingParams(max_tokens=6, stop_token_ids=[])
    want = llm.generate("def f(", sp, SpecConfig("ar"))[0].text
    s = llm.stream("def f(", sp, SpecConfig("ar"))
    text = next(s)
    with pytest.raises(RuntimeError, match="still being iterated"):
        llm.generate("x", sp)
    text += "".join(s)
    assert text == want


def test_open_batch_keeps_an_open_batchs_unfinished_rows(llm):
    # (a second open_batch() dropped them; their slots then named the new batch's rows)
    llm.open_batch(SpecConfig("ar"), capacity=2)
    (slot,) = llm.admit([[5, 17, 30]], [SamplingParams(max_tokens=10)])
    llm.step()
    with pytest.raises(RuntimeError, match=r"open_batch\(\): the open batch has 1 unfinished row"):
        llm.open_batch(SpecConfig("ar"), capacity=2)
    llm.release(slot)
    llm.open_batch(SpecConfig("ar"), capacity=2)  # once released: a new batch


@pytest.mark.parametrize(
    "prompt, error, needle",
    [
        ([1.0, 2.0], TypeError, "token id 1.0 at position 0 is a float"),  # (was: prompt 0 is a float)
        (memoryview(b"ab"), TypeError, "prompts is a memoryview"),  # (ran as ids [97, 98])
    ],
)
def test_prompts_that_were_taken_otherwise_are_named(llm, prompt, error, needle):
    with pytest.raises(error, match=needle):
        llm.generate(prompt)


@pytest.mark.parametrize("kw", [{"stop": {"a": 1}}, {"stop_token_ids": {1: 2}}])
def test_a_dict_is_no_list_of_stops(kw):
    # (its keys were taken: stop=('a',), stop_token_ids=(1,))
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_max_batch_none_is_named(tiny_k25):
    with pytest.raises(ValueError, match="max_batch=None: expected an integer"):
        k26.LLM(tiny_k25, device="cpu", max_batch=None, progress=False)


def test_a_context_warning_names_the_users_line():
    # (it named k26/engine.py, so Python's once-per-location filter showed it once for every call site)
    small = LLM(device="cpu", dtype=torch.float32, progress=False, max_model_len=24)  # the embedded pair
    try:
        with pytest.warns(UserWarning, match="DDTree budgets limited to") as got:
            small.generate([5, 6], SamplingParams(max_tokens=2))
        assert got[0].filename == __file__
    finally:
        small.close()


def test_a_lone_surrogate_in_a_prompt_is_named_not_replaced(llm):
    # (it was encoded as U+FFFD, ids [239, 191, 189], silently; the server refuses such a body with a 400)
    with pytest.raises(ValueError, match="prompt 1: text holds an unpaired UTF-16 surrogate at character 2"):
        llm.generate(["ok", "ab\ud800c"])
    with pytest.raises(ValueError, match="prompt 0: text holds an unpaired UTF-16 surrogate at character 1"):
        llm.generate(["🤖\ud800"])  # (an astral character before it is one character, not a pair)
    assert llm.tokenizer.decode(llm.tokenizer.encode("a🤖b")) == "a🤖b"  # a valid astral character is text
