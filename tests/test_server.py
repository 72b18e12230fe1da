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
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from http_app import serving

from k26 import LLM, SamplingParams, SpecConfig
from k26.chat import ChatFormat, Message, ToolCall, render
from k26.server import Engine, create_app

MODEL = "k26-test"
SPEC = SpecConfig("ddtree", 8)
PROMPTS = [
    "def main(",
    "import os\n",
    "class Foo(object):\n",
    "    return ",
    "for i in range(",
    "if __name__ ==",
    "# Copyright",
    "self.",
]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def main("}]


@pytest.fixture(scope="module")
def served():
    llm = LLM(device="cpu", dtype=torch.float32, progress=False, max_batch=8, max_model_len=96)
    # references first: once the engine runs, its thread alone may touch the model
    refs = {p: llm.generate(p, SamplingParams(max_tokens=12), SPEC)[0] for p in PROMPTS}
    short = {p: llm.generate(p, SamplingParams(max_tokens=2), SPEC)[0].text for p in PROMPTS}
    lp_ref = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, logprobs=3), SPEC)[0]
    scored = llm.generate(PROMPTS[2], SamplingParams(max_tokens=0, prompt_logprobs=1), SPEC)[0]
    fmt = ChatFormat.for_model(llm.config.model_type)
    chats = {
        on: llm.generate(
            render(llm.tokenizer, CHAT, fmt.with_thinking(on)), SamplingParams(max_tokens=8), SPEC
        )[0]
        for on in (True, False)
    }
    engine = Engine(llm, SPEC, max_waiting=64)
    engine.start()
    with serving(create_app(engine, MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield {
            "url": url,
            "client": client,
            "engine": engine,
            "refs": refs,
            "short": short,
            "llm": llm,
            "chats": chats,
            "lp_ref": lp_ref,
            "scored": scored,
        }
    engine.stop()


def greedy(**kw):
    return dict(temperature=0, max_tokens=12, **kw)


def raw(url: str, path: str, data: bytes | None = None, method: str | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            body = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        body, status = e.read().decode(), e.code
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body


def metric(url: str, name: str) -> float:
    text = raw(url, "/metrics")[1]
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


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


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_whole_and_streamed(served, thinking):
    """The embedded target is K2.6-format: thinking (the default) answers in reasoning_content."""
    c, llm, ref = served["client"], served["llm"], served["chats"][thinking]
    ids = render(llm.tokenizer, CHAT, ChatFormat.for_model(llm.config.model_type).with_thinking(thinking))
    assert llm.chat_ids(CHAT, thinking=thinking) == ids  # the Python API's way to the same prompt
    kw = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 8}
    kw["extra_body"] = {} if thinking else {"chat_template_kwargs": {"thinking": False}}
    whole = c.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.usage.prompt_tokens == len(ids) and msg.role == "assistant"
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert (reasoning is not None) == thinking
    assert (reasoning or "") + msg.content == ref.text and whole.usage.completion_tokens == len(ref.token_ids)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == msg.content
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == (reasoning or "")
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # the usage chunk comes last


def test_completion_logprobs_whole_and_streamed(served):
    c, ref = served["client"], served["lp_ref"]
    whole = c.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, **greedy())
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    assert len(lp.tokens) == whole.usage.completion_tokens and "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert [max(t.values()) for t in lp.top_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)  # greedy
    zero = c.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=0, **greedy()).choices[0].logprobs
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs)]  # the sampled one
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, stream=True, **greedy()))
    got = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(lp.token_logprobs, abs=1e-5)  # (another batch row: float rounding may differ)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(served, max_tokens):
    """What evaluation harnesses send for a log-likelihood (echo, logprobs, max_tokens 0 or 1)."""
    c, ref = served["client"], served["scored"]
    kw = {"model": MODEL, "prompt": PROMPTS[2], "echo": True, "logprobs": 1, "temperature": 0}
    kw["max_tokens"] = max_tokens
    r = c.completions.create(**kw)
    lp, n = r.choices[0].logprobs, len(ref.prompt_token_ids)
    assert r.choices[0].text.startswith(PROMPTS[2]) and len(lp.tokens) == n + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    want = [x.logprob for x in ref.prompt_logprobs[1:]]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-5)
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset == sorted(lp.text_offset)
    chunks = list(c.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    got = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.tokens]
    assert got == lp.tokens
    plain = c.completions.create(
        model=MODEL, prompt=PROMPTS[2], echo=True, max_tokens=max_tokens, temperature=0
    )
    assert plain.choices[0].text == r.choices[0].text and plain.choices[0].logprobs is None


def test_logprobs_stop_with_the_text_a_stop_string_cuts(served):
    """Tokens of the cut stop string get no logprobs, whole or streamed."""
    c, ref = served["client"], served["refs"][PROMPTS[0]]
    stop = ref.text[len(ref.text) // 2 :][:3]
    kw = dict(model=MODEL, prompt=PROMPTS[0], logprobs=1, stop=[stop], **greedy())
    whole = c.completions.create(**kw)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert stop not in text and lp.text_offset and all(off < len(text) for off in lp.text_offset)
    assert len(lp.tokens) < whole.usage.completion_tokens
    chunks = list(c.completions.create(**kw, stream=True))
    got = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.tokens]
    assert got == lp.tokens


def test_chat_logprobs_whole_and_streamed(served):
    c = served["client"]
    kw = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 8}
    kw |= {"logprobs": True, "top_logprobs": 2}
    whole = c.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens  # every generated token (reasoning included)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)  # greedy
    assert all(
        bytes(e.bytes).decode("utf-8", "replace") == e.token or e.token.startswith("bytes:") for e in content
    )
    chunks = list(c.chat.completions.create(**kw, stream=True))
    got = [
        e.token
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert got == [e.token for e in content]


def test_chat_renders_tools_tool_calls_and_tool_results(served):
    c, llm = served["client"], served["llm"]
    tools = [{"type": "function", "function": {"name": "f"}}]  # (the context holds 96 tokens)
    call = {
        "id": "functions.f:0",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "t"},
        {"role": "tool", "tool_call_id": call["id"], "content": "s"},
    ]
    fmt = ChatFormat.for_model(llm.config.model_type)
    got = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=1, temperature=0)
    want = [
        Message("system", "s"),
        Message("user", "w?"),
        Message("assistant", "", reasoning="t", tool_calls=(ToolCall(call["id"], "f", "{}"),)),
        Message("tool", "s", tool_call_id=call["id"]),
    ]
    assert got.usage.prompt_tokens == len(render(llm.tokenizer, want, fmt, tools))
    none = c.chat.completions.create(
        model=MODEL, messages=msgs, tools=tools, tool_choice="none", max_tokens=1
    )
    assert none.usage.prompt_tokens == len(render(llm.tokenizer, want, fmt))  # "none": no tools declared


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


SEEDED = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 10, "extra_body": {"top_k": 50}}


def test_n_greedy_choices_each_equal_generate(served):
    c, ref = served["client"], served["refs"][PROMPTS[0]]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], n=3, **greedy())
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.text == ref.text and ch.finish_reason == ref.finish_reason for ch in r.choices)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)  # the prompt counted once
    assert r.usage.completion_tokens == 3 * len(ref.token_ids)


def endpoint(c, chat: bool, prompt: str):
    """One endpoint's (create, seeded-sampling kwargs, a whole choice's text, a streamed choice's piece)."""
    if chat:
        ask = dict(messages=[{"role": "user", "content": prompt}], **SEEDED)
        return (
            c.chat.completions.create,
            ask,
            lambda ch: ch.message.content,
            lambda ch: ch.delta.content or "",
        )
    return c.completions.create, dict(prompt=prompt, **SEEDED), lambda ch: ch.text, lambda ch: ch.text


def test_n_seeded_choice_i_is_the_request_with_seed_plus_i(served):
    c = served["client"]
    for chat in (False, True):
        make, ask, text, _ = endpoint(c, chat, PROMPTS[1])
        many = make(model=MODEL, n=3, seed=11, **ask).choices
        alone = [text(make(model=MODEL, seed=11 + i, **ask).choices[0]) for i in range(3)]
        assert [text(ch) for ch in many] == alone


def test_n_streamed_choices_equal_whole(served):
    c = served["client"]
    for chat in (False, True):
        make, ask, text, piece = endpoint(c, chat, PROMPTS[2])
        whole = make(model=MODEL, n=3, seed=5, **ask)
        chunks = list(
            make(model=MODEL, n=3, seed=5, stream=True, stream_options={"include_usage": True}, **ask)
        )
        got, finishes = ["", "", ""], [[], [], []]
        for ch in chunks[:-1]:
            (part,) = ch.choices  # one choice a chunk
            got[part.index] += piece(part)
            finishes[part.index].append(part.finish_reason)
        assert got == [text(ch) for ch in whole.choices]
        for i, f in enumerate(finishes):  # each choice's finish reason once, on its last chunk
            assert f[-1] == whole.choices[i].finish_reason and all(x is None for x in f[:-1])
        assert (
            chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        )


def test_prompt_list_answers_each_prompt_in_prompt_major_order(served):
    c, refs = served["client"], served["refs"]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[:3], n=2, **greedy())
    assert [ch.index for ch in r.choices] == list(range(6))
    assert [ch.text for ch in r.choices] == [refs[p].text for p in PROMPTS[:3] for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(refs[p].prompt_token_ids) for p in PROMPTS[:3])  # each once
    assert r.usage.completion_tokens == 2 * sum(len(refs[p].token_ids) for p in PROMPTS[:3])


def test_n_choices_are_queued_together_or_not_at_all(served):
    engine, c = served["engine"], served["client"]
    import asyncio

    from k26.server.engine import QueueFull
    from k26.server.engine import Request as EngineRequest

    loop = asyncio.new_event_loop()
    requests = engine.metrics.requests
    engine.max_waiting = 4
    try:
        reqs = [EngineRequest([1, 2], SamplingParams(max_tokens=1), loop, choice=i) for i in range(5)]
        with pytest.raises(QueueFull, match="needs 5"):
            engine.submit(reqs)
        assert engine.pending == 0 and engine.metrics.requests == requests  # none of the five went in
        with engine.lock:  # two rows already waiting (the engine only lowers it when it admits real rows)
            engine.pending = 2
        try:
            with pytest.raises(QueueFull, match="2 rows wait"):  # 3 would fit alone, not beside the 2
                engine.submit(reqs[:3])
            assert engine.pending == 2 and engine.metrics.requests == requests
        finally:
            with engine.lock:
                engine.pending = 0
        with pytest.raises(openai.BadRequestError, match="max-waiting 4"):  # never servable: 400, not 429
            c.completions.create(model=MODEL, prompt="x", max_tokens=1, n=5)
    finally:
        engine.max_waiting = 64
        loop.close()
    assert len(c.completions.create(model=MODEL, prompt="x", max_tokens=1, n=4).choices) == 4


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
