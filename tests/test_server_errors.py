"""`python -m k26 serve`, its error paths, on the session's served embedded pair (conftest.py `served`):
every bad input gets its 4xx with an OpenAI-style error naming the field and the server stays up; a full
queue answers 429; a failed engine step answers 500 (and ends an `n`-choice stream with the error) and the
server goes on; an admission refused for one request fails only that request."""

import json
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from served import CHAT, MODEL, PROMPTS, greedy, metric, raw

BAD = [
    ("/v1/completions", b'{"model": "k26-test", "prompt": ', 400, None),
    # UTF-16 (json.loads takes it from bytes): its lone surrogate slipped past the escape check into the
    # unknown-argument error, whose rendering then failed (500)
    (
        "/v1/completions",
        '{"model": "k26-test", "prompt": "hi", "x\ud800": 1}'.encode("utf-16-le", "surrogatepass"),
        400,
        None,
    ),
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
    ("/v1/completions", {"model": MODEL, "prompt": ["a", 5]}, 400, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 6, "a"]}, 400, "prompt[2]"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", None]}, 400, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": [None, "a"]}, 400, "prompt[0]"),  # (neither kind)
    # a token-id prompt's element that is no id, named by its index (found in a bug hunt: "prompt: expected a
    # string or a list of token ids, got list", the list itself)
    ("/v1/completions", {"model": MODEL, "prompt": [1, 1.5]}, 400, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": [True]}, 400, "prompt[0]"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [3, "a"]]}, 400, "prompt[1][1]"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 1.5]]}, 400, "prompt[0][1]"),  # (a list of one)
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": 1}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": 0}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "user": 42}, 400, "user"),
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
            ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools[0].function.name"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
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
        "messages[0].tool_call_id",
    ),
    # NaN / Infinity are no JSON (json.loads took them: into a tool schema, so into the prompt)
    (
        "/v1/chat/completions",
        (
            b'{"model": "k26-test", "messages": [{"role": "user", "content": "x"}], '
            b'"tools": [{"type": "function", "function": {"name": "f", "parameters": {"default": NaN}}}]}'
        ),
        400,
        None,
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
    # a part that is not text, named by its index (found in a bug hunt: only messages[0].content was named)
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {}}],
                }
            ],
        },
        400,
        "messages[0].content[1]",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [7]}]},
        400,
        "messages[0].content[0]",
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


@pytest.mark.parametrize(
    "path, body, quoted",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, "max_tokens=true"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "10"}, 'max_tokens="10"'),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": {"a": 1}}, 'stop={"a": 1}'),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": None, "echo": 1.5}, "echo=1.5"),
        ("/v1/completions", {"model": "m" * 1000, "prompt": "x"}, '"mmm'),
    ],
)
def test_a_bad_value_is_quoted_in_json_as_the_client_sent_it(served, path, body, quoted):
    # (it was Python's repr: max_tokens=True, stop={'a': 1}; a long value is cut, not echoed whole)
    _, err = raw(served["url"], path, json.dumps(body).encode())
    message = err["error"]["message"]
    assert quoted in message and len(message) < 300, message


def test_a_quoted_value_renders_only_what_the_message_shows():
    from k26.server.json_values import short

    big = list(range(3_000_000))
    assert short(big).startswith("[0, 1, 2") and len(short(big)) == 80
    assert short("x" * (64 << 20)) == '"' + "x" * 76 + "..."
    assert short([[[[[[1]]]]]]) == '[[[["..."]]]]' and short({"a": True}) == '{"a": true}'
    assert short(float("nan")) == "NaN" and short(object()).startswith("<object")


def test_detokenize_names_a_missing_tokens_field_as_every_endpoint_does(served):
    status, err = raw(served["url"], "/detokenize", json.dumps({"model": MODEL}).encode())
    assert (status, err["error"]["param"]) == (400, "tokens")
    assert err["error"]["message"] == "missing required parameter: 'tokens'"


def test_max_tokens_beyond_one_listed_prompts_room_names_that_prompt(served):
    """Each prompt of a list has its own room: the 400 names the one the ask does not fit."""
    tok, max_len = served["llm"].tokenizer, served["llm"].max_model_len
    long = "x " * 30
    ask = max_len - len(tok.encode(long)) + 1  # one beyond the long prompt's room, within the short one's
    body = {"model": MODEL, "prompt": ["x", long], "max_tokens": ask}
    got, err = raw(served["url"], "/v1/completions", json.dumps(body).encode())
    assert got == 400 and err["error"]["param"] == "max_tokens", err
    assert "after prompt[1]" in err["error"]["message"] and err["error"]["code"] == "context_length_exceeded"


def test_full_queue_answers_429(served):
    engine, c = served["engine"], served["client"]
    engine.max_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError, match="capacity") as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.response.headers["retry-after"] == "1"  # (the client's own retries wait that long)
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


def test_a_step_that_breaks_the_llm_ends_the_engine_and_health_says_so(monkeypatch):
    # (a dead TP rank: the engine stepped the broken batch forever at 100 % CPU, answering nothing, while
    # /health said ok; and the first request's error carried the rank's traceback, file paths included)
    import torch
    from http_app import serving

    from k26 import LLM, SpecConfig
    from k26.server import Engine, create_app
    from k26.tp_driver import RankError

    llm = LLM(device="cpu", dtype=torch.float32, progress=False, max_batch=1, max_model_len=64)
    engine = Engine(llm, SpecConfig("ar"), max_waiting=4)
    engine.start()
    why = "its tensor-parallel ranks failed (rank 1: killed by SIGKILL); close() it and make a new LLM"

    def dead(*a, **k):
        monkeypatch.setattr(LLM, "broken", property(lambda self: why))
        trace = 'Traceback (most recent call last):\n  File "/x/k26/decode.py", line 1\nRuntimeError: gloo'
        raise RankError(f"tensor-parallel rank 1 failed: killed by SIGKILL; its stderr ends:\n{trace}")

    monkeypatch.setattr(llm, "step", dead)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4}).encode()
    try:
        with serving(create_app(engine, MODEL)) as url:
            status, err = raw(url, "/v1/completions", body)
            assert status == 503 and err["error"]["code"] == "engine_down", err
            assert "rank 1 failed: killed by SIGKILL" in err["error"]["message"]
            assert "File " not in err["error"]["message"]
            engine.thread.join(10)
            status, health = raw(url, "/health")
            assert status == 503 and "rank 1 failed" in health["error"] and not engine.thread.is_alive()
            status, err = raw(url, "/v1/completions", body)
            assert status == 503 and err["error"]["code"] == "engine_down", err
    finally:
        engine.stop()
        monkeypatch.undo()
        llm.close()
