"""/metrics against what the clients received, on an autoregressive server (CPU, the embedded pair): tau is
exactly 1 there, and a request's counters move before its client has the answer."""

import json
import urllib.request

import pytest
import torch

pytest.importorskip("uvicorn")

from http_app import serving
from served import MODEL, PROMPTS, metric


@pytest.fixture(scope="module")
def ar_url():
    from k26 import LLM, SpecConfig
    from k26.server import Engine, create_app

    llm = LLM(device="cpu", dtype=torch.float32, progress=False, max_batch=2, max_model_len=64)
    engine = Engine(llm, SpecConfig("ar"), max_waiting=4)
    engine.start()
    try:
        with serving(create_app(engine, MODEL)) as url:
            yield url
    finally:
        engine.stop()


def complete(url: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def test_tau_is_one_token_per_forward_on_an_autoregressive_server(ar_url):
    # Each request's prefill ends inside the step that first decodes it (admission without waiting): that
    # step's row and its tokens count, the prompt's first token (sampled by the prefill) does not.
    for n in (2, 1, 7):
        complete(ar_url, n)
    assert metric(ar_url, "k26_tau") == 1.0


def test_a_finished_request_is_counted_before_its_client_has_the_answer(ar_url):
    for _ in range(10):
        finished, tokens = (
            metric(ar_url, "k26_requests_finished_total"),
            metric(ar_url, "k26_generation_tokens_total"),
        )
        n = complete(ar_url, 3)["usage"]["completion_tokens"]
        assert metric(ar_url, "k26_requests_finished_total") == finished + 1
        assert metric(ar_url, "k26_generation_tokens_total") == tokens + n


def run_engine(llm, script) -> tuple:
    """An autoregressive engine over `llm`, `script(engine, submit, seen)` run while it serves (`submit`
    queues one row; `seen`: the running gauge at each step's start, as the boundary before left it); the
    engine and `seen` once it has stopped."""
    import asyncio

    from k26 import SpecConfig
    from k26.server import Engine
    from k26.server.engine import Request

    engine = Engine(llm, SpecConfig("ar"))
    seen, step = [], llm.step
    llm.step = lambda: (seen.append(engine.metrics.running), step())[1]
    loop = asyncio.new_event_loop()
    engine.start()
    try:
        script(engine, lambda ids, sp: engine.submit([Request(ids, sp, loop)]), seen)
    finally:
        engine.stop()
        loop.close()
    return engine, seen


def wait_until(cond, deadline: float) -> None:
    import time

    while not cond() and time.time() < deadline:
        time.sleep(0.01)


def test_a_request_still_prefilling_counts_as_running():
    """A row admitted and still prefilling is in the batch, from its admission on: /metrics showed an idle
    server (running 0, waiting 0) through a long prompt's prefill (a review: > 3.6 s for 2.7K tokens)."""
    import time

    from k26 import LLM, SamplingParams

    def script(engine, submit, seen):  # max_tokens 1: the prefill samples the only token, no decoding row
        submit(list(range(5, 65)), SamplingParams(max_tokens=1))
        wait_until(lambda: engine.metrics.finished >= 1, time.time() + 60)

    llm = LLM(device="cpu", dtype=torch.float32, progress=False, max_batch=2, max_model_len=128)
    engine, seen = run_engine(llm, script)
    assert engine.metrics.finished == 1 and seen == [1] and engine.metrics.running == 0


def test_a_prompt_prefilling_beside_a_decoding_row_counts_through_its_steps():
    """A long prompt admitted beside a decoding row prefills over several steps (the prefill budget's
    positions each): it counts as running through all of them, not only in the step it was admitted in."""
    import time

    from k26 import LLM, SamplingParams

    def script(engine, submit, seen):
        deadline = time.time() + 60
        submit([5, 6, 7], SamplingParams(max_tokens=40, stop_token_ids=[]))
        wait_until(lambda: len(seen) >= 3, deadline)
        submit(list(range(5, 65)), SamplingParams(max_tokens=1))
        wait_until(lambda: engine.metrics.finished >= 2, deadline)

    llm = LLM(
        device="cpu",
        dtype=torch.float32,
        progress=False,
        max_batch=2,
        max_model_len=128,
        prefill_chunk=8,
        prefill_budget=8,
    )
    engine, seen = run_engine(llm, script)
    assert engine.metrics.finished == 2 and seen.count(2) >= 3  # 60 positions at 8 a step: >= 7 steps
