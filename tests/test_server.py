"""`python -m k26 serve`: the official `openai` client against a server on a free loopback port, CPU, the
embedded pair with DDTree. Greedy output equals `LLM.generate`; concurrent streams equal their solo runs;
a dropped client frees its row; every bad input gets its 4xx with an OpenAI-style error; a load run loses
and duplicates nothing."""

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from http_app import serving
from served import CHAT, MODEL, PROMPTS, greedy, metric, raw

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
    later = c.completions.create(model=MODEL, prompt=PROMPTS[2], **greedy())
    assert later.usage.completion_tokens > 0


BAD = [
    ("/v1/completions", b'{"model": "k26-test", "prompt": ', 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 200}, 400, "prompt"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x " * 200}]},
        400,
        "messages",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 96}, 400, "max_tokens"),  # > the room
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_completion_tokens": 96},
        400,
        "max_completion_tokens",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": "2"}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": True}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**63 - 2, "n": 3}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", 5]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": 1}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": 0}, 400, "echo"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": "no"}},
        400,
        "stream_options",
    ),
    *[
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **extra},
            400,
            p,
        )
        for extra, p in [
            ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools[0]"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1]"),
            ({"tools": {"name": "f"}}, "tools"),
            (
                {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
                "tool_choice",
            ),
            ({"tool_choice": "auto"}, "tool_choice"),
            ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
            ({"logprobs": 3}, "logprobs"),
            ({"top_logprobs": 2}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"chat_template_kwargs": {"thinking": "off"}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": {"preserve_thinking": 1}}, "chat_template_kwargs"),
        ]
    ],
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0]",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"id": "a"}]}]},
        400,
        "messages[0].tool_calls[0]",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": None}]},
        400,
        "messages[0].content",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of_the_rest": 1}, 400, "best_of_the_rest"),
    (
        "/v1/completions",
        b'{"model": "k26-test", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        400,
        None,
    ),
    (
        "/v1/completions",
        b'{"model": "k26-test", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}",
        400,
        None,
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**70}, 400, "top_k"),
    ("/v1/completions", b'{"model": "k26-test", "prompt": "a\\ud800b"}', 400, "prompt"),
    (
        "/v1/chat/completions",
        b'{"model": "k26-test", "messages": [{"role": "user", "content": "\\udc00"}]}',
        400,
        "messages[0].content",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": "a" * 513}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": True}, 400, "best_of"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
        400,
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 3,
            "max_tokens": -5,
        },
        400,
        "max_tokens",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {str(10**9): 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": [5, 1]}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "presence_penalty": 10**400},
        400,
        "presence_penalty",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 10**400}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "ignore_eos": 1}, 400, "ignore_eos"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": "2"}, 400, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [5, 10**9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [True]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": 5}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [1] * 65}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", [5, 10**9]]}, 400, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "x " * 200]}, 400, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 65}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "function", "content": "x"}]},
        400,
        "messages[0].role",
    ),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[2]}-{b[3]}" for b in BAD])
def test_bad_input_gets_its_4xx(served, path, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, err = raw(served["url"], path, data)
    assert got == status, err
    assert set(err["error"]) >= {"message", "type", "param"} and err["error"]["message"]
    assert err["error"]["param"] == param
    assert raw(served["url"], "/health")[0] == 200  # the server stays up


def test_full_queue_answers_429(served):
    engine, c = served["engine"], served["client"]
    engine.max_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError, match="capacity"):
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
    finally:
        engine.max_waiting = 64
    assert c.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_failed_step_answers_500_and_the_server_goes_on(served, monkeypatch):
    c, llm = served["client"], served["llm"]

    def broken():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(llm, "step", broken)
    with pytest.raises(openai.InternalServerError, match="injected step failure"):
        c.completions.create(model=MODEL, prompt=PROMPTS[0], **greedy())
    monkeypatch.undo()
    ref = served["refs"][PROMPTS[0]]
    assert c.completions.create(model=MODEL, prompt=PROMPTS[0], **greedy()).choices[0].text == ref.text


def test_failed_step_with_n_choices_answers_500_and_ends_the_stream(served, monkeypatch):
    c, llm, url = served["client"], served["llm"], served["url"]

    def broken():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(llm, "step", broken)
    with pytest.raises(openai.InternalServerError, match="injected step failure"):
        c.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, **greedy())
    body = {"model": MODEL, "prompt": PROMPTS[0], "n": 2, "stream": True, "max_tokens": 12, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = [ln for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    assert "injected step failure" in lines[-2] and lines[-1] == "data: [DONE]"  # the error, then the end
    monkeypatch.undo()
    deadline = time.time() + 20
    while time.time() < deadline and metric(url, "k26_requests_running") > 0:
        time.sleep(0.1)
    assert metric(url, "k26_requests_running") == 0  # no row left behind
    ref = served["refs"][PROMPTS[0]]
    assert c.completions.create(model=MODEL, prompt=PROMPTS[0], **greedy()).choices[0].text == ref.text


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


def test_a_refused_admission_fails_only_its_own_request(served, monkeypatch):
    """llm.admit refusing (or rolling back) one request's rows answers that request 500; a request already
    decoding goes on to its end (the engine failed every running row with it)."""
    import threading

    c, llm, url = served["client"], served["llm"], served["url"]
    real = llm.admit
    bad = llm.tokenizer.encode("zebra zebra")

    def admit(prompts, params, wait=True):
        if bad in prompts:
            raise ValueError("injected admission refusal")
        return real(prompts, params, wait)

    monkeypatch.setattr(llm, "admit", admit)
    long_answer: dict = {}

    def run_long():
        try:
            long_answer["r"] = c.completions.create(
                model=MODEL, prompt=PROMPTS[1], max_tokens=70, temperature=0
            )
        except Exception as e:  # noqa: BLE001 - the assertion below says what it was
            long_answer["r"] = e

    t = threading.Thread(target=run_long)
    t.start()
    deadline = time.time() + 20
    while time.time() < deadline and metric(url, "k26_requests_running") < 1:
        time.sleep(0.01)
    with pytest.raises(openai.InternalServerError, match="injected admission refusal"):
        c.completions.create(model=MODEL, prompt=bad, max_tokens=4)
    t.join(timeout=60)
    assert not isinstance(long_answer["r"], Exception), long_answer["r"]
    assert long_answer["r"].usage.completion_tokens > 0
