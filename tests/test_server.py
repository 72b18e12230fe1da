"""`python -m k26 serve`: the official `openai` client against a server on a free loopback port, CPU, the
embedded pair with DDTree. Greedy output equals `LLM.generate`; concurrent streams equal their solo runs;
a dropped client frees its row; a load run loses and duplicates nothing. The error paths (bad inputs,
429, failed steps) are in test_server_errors.py."""

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from http_app import serving
from served import MODEL, PROMPTS, greedy, metric, raw

from k26.server import create_app


def test_models_health_and_metrics(served):
    assert [m.id for m in served["client"].models.list().data] == [MODEL]
    assert raw(served["url"], "/health") == (200, {"status": "ok"})
    text = raw(served["url"], "/metrics")[1]
    for name in (
        "k26_generation_tokens_per_second",
        "k26_tau",
        "k26_step_seconds_mean",
        "k26_requests_running",
        "k26_requests_waiting",
    ):
        assert f"# TYPE {name} gauge" in text


def test_latency_histograms_count_each_finished_request(served):
    c, url = served["client"], served["url"]
    names = ("k26_time_to_first_token_seconds", "k26_time_per_output_token_seconds", "k26_request_seconds")
    before = {n: metric(url, n + "_count") for n in names}
    c.completions.create(model=MODEL, prompt=PROMPTS[3], **greedy())  # 12 tokens: one of each
    text = raw(url, "/metrics")[1]
    for n in names:
        assert f"# TYPE {n} histogram" in text and metric(url, n + "_count") == before[n] + 1
        buckets = [float(line.split()[1]) for line in text.splitlines() if line.startswith(n + "_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == metric(
            url, n + "_count"
        )  # cumulative, +Inf last
    assert 0 < metric(url, "k26_time_per_output_token_seconds_sum") <= metric(url, "k26_request_seconds_sum")


def test_greedy_completion_equals_generate(served):
    c = served["client"]
    for p in PROMPTS[:3]:
        ref = served["refs"][p]
        r = c.completions.create(model=MODEL, prompt=p, **greedy())
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_completion_equals_whole(served):
    c = served["client"]
    whole = c.completions.create(model=MODEL, prompt=PROMPTS[0], **greedy())
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **greedy()))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_stop_string_and_seeded_sampling(served):
    c = served["client"]
    full = c.completions.create(model=MODEL, prompt=PROMPTS[0], **greedy()).choices[0].text
    stop = full[3:9]  # long enough to straddle tokens and steps
    cut = c.completions.create(model=MODEL, prompt=PROMPTS[0], stop=[stop], **greedy()).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    chunks = c.completions.create(model=MODEL, prompt=PROMPTS[0], stop=[stop], stream=True, **greedy())
    assert "".join(ch.choices[0].text for ch in chunks) == cut.text  # no piece of the stop string leaks
    kw = {
        "model": MODEL,
        "prompt": PROMPTS[1],
        "temperature": 1.0,
        "top_p": 0.9,
        "max_tokens": 10,
        "seed": 7,
        "extra_body": {"top_k": 50},
    }
    a = c.completions.create(**kw).choices[0].text
    with ThreadPoolExecutor(
        4
    ) as ex:  # the seed is the request's own: its neighbours in the batch do not matter
        together = list(ex.map(lambda _: c.completions.create(**kw).choices[0].text, range(4)))
    assert together == [a] * 4
    others = [c.completions.create(**{**kw, "seed": s}).choices[0].text for s in (8, 9, 10)]
    assert any(o != a for o in others)  # the request's seed, not a fixed stream, decides the tokens


def test_eight_concurrent_streams_each_equal_alone(served):
    c = served["client"]

    def one(p):
        return "".join(
            ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=p, stream=True, **greedy())
        )

    alone = [c.completions.create(model=MODEL, prompt=p, **greedy()).choices[0].text for p in PROMPTS]
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(one, PROMPTS))
    assert together == alone


@pytest.mark.parametrize("keyed", [False, True])
def test_a_whole_answer_whose_client_left_frees_its_row(served, monkeypatch, keyed):
    """Non-streamed: the handler looks for its client once a second — also behind the API key's middleware."""
    llm, engine = served["llm"], served["engine"]
    step = llm.step
    monkeypatch.setattr(llm, "step", lambda: (time.sleep(0.1), step())[1])  # a request outlives its client
    key = "k" if keyed else None
    with serving(create_app(engine, MODEL, api_key=key)) as url:
        before = metric(url, "k26_requests_cancelled_total")
        body = json.dumps({"model": MODEL, "prompt": "def f(", "max_tokens": 80, "temperature": 0}).encode()
        host, port = url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        head += (
            f"Content-Length: {len(body)}\r\n" + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n"
        )
        sock.sendall(head.encode() + body)
        time.sleep(1.0)
        sock.close()  # gone before its answer
        deadline = time.time() + 15
        while time.time() < deadline and metric(url, "k26_requests_cancelled_total") < before + 1:
            time.sleep(0.1)
        assert metric(url, "k26_requests_cancelled_total") == before + 1
        assert_every_row_free(llm)


def assert_every_row_free(llm):
    """The batch's rows all come back (a cancelled request's row released, not just counted)."""
    deadline = time.time() + 10
    while time.time() < deadline and len(llm.batch.free_slots()) < llm.batch.capacity:
        time.sleep(0.05)
    assert len(llm.batch.free_slots()) == llm.batch.capacity


@pytest.mark.parametrize("n", [1, 2])
def test_dropped_client_frees_its_rows(served, n):
    url, c = served["url"], served["client"]
    before = metric(url, "k26_requests_cancelled_total")
    req = urllib.request.Request(
        url + "/v1/completions",
        headers={"Content-Type": "application/json"},
        data=json.dumps(
            {"model": MODEL, "prompt": "def f(", "max_tokens": 80, "temperature": 0, "stream": True, "n": n}
        ).encode(),
    )
    r = urllib.request.urlopen(req, timeout=60)
    assert r.readline().startswith(b"data: {")  # the stream is running
    r.close()  # the client goes away mid-stream
    deadline = time.time() + 20
    while time.time() < deadline and (
        metric(url, "k26_requests_cancelled_total") < before + n or metric(url, "k26_requests_running") > 0
    ):
        time.sleep(0.1)
    assert metric(url, "k26_requests_cancelled_total") == before + n
    assert metric(url, "k26_requests_running") == 0
    assert_every_row_free(served["llm"])
    later = c.completions.create(model=MODEL, prompt=PROMPTS[2], **greedy())
    assert later.usage.completion_tokens > 0


def test_load_run_loses_and_duplicates_nothing(served):
    """200 greedy requests, 16 at a time, over 8 rows: each answer is its own prompt's, none lost or twice."""
    c, url, short = served["client"], served["url"], served["short"]
    done_before = metric(url, "k26_requests_finished_total")
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(200)]

    def one(p):
        r = c.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=2)
        return r.id, r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, jobs))
    assert len({g[0] for g in got}) == 200
    for p, (_, text, n) in zip(jobs, got):
        assert text == short[p] and n <= 2
    assert metric(url, "k26_requests_finished_total") == done_before + 200
    assert metric(url, "k26_requests_waiting") == 0


def test_requests_whose_clients_left_while_queued_free_their_places():
    """A waiting request whose client went away leaves the queue at the next boundary even when no row is
    free (its place counted against max_waiting until a row freed: new requests got 429)."""
    import asyncio
    from types import SimpleNamespace

    from k26 import SamplingParams
    from k26.server.engine import Engine, Request

    full = SimpleNamespace(free_slots=list, live=[], pending=[])  # every row busy, nothing to step
    engine = Engine(SimpleNamespace(cache=SimpleNamespace(rows=1)), None, max_waiting=2)  # (no model needed)
    loop = asyncio.new_event_loop()
    try:
        reqs = [Request([1], SamplingParams(), loop) for _ in range(2)]
        engine.submit(reqs)
        engine._take(block=False)
        reqs[0].cancelled = True
        engine._boundary(full)
        assert list(engine.waiting) == [reqs[1]] and engine.pending == 1
        assert engine.metrics.cancelled == 1
        engine.submit([Request([2], SamplingParams(), loop)])  # the place is free again: no QueueFull
    finally:
        loop.close()
