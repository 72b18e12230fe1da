"""The chat endpoint's answers in the Kimi format over HTTP, read with the official `openai` client: a
scripted engine (it answers every row with fixed output ids, in random-sized events, as the engine
thread would) stands in for the model, whose tiny embedded target never writes tool calls. Reasoning,
content and tool calls come out the same whole and streamed; parallel_tool_calls = false keeps one call."""

import json
import random
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from http_app import serving
from test_chat import two_calls  # the output script: reasoning, content, two calls

from k26.server import create_app
from k26.server.engine import Event, Metrics
from k26.tokenizer import Tokenizer

MODEL = "k26-scripted"
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "weather in Zürich and the time?"}]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


class ScriptedEngine:
    """What `create_app` needs of an engine; `submit` pushes the script's tokens to every row at once."""

    def __init__(self, path, tok: Tokenizer, script: list[int], seed: int = 0):
        config = SimpleNamespace(model_type="kimi_k25", vocab_size=tok.n_words)
        self.llm = SimpleNamespace(path=path, tokenizer=tok, config=config, max_model_len=4096)
        self.script, self.rng = script, random.Random(seed)
        self.max_waiting, self.error, self.metrics = 64, None, Metrics()
        self.logprobs = True  # (serve --no-logprobs: False)
        self.thread = threading.main_thread()  # alive: /health answers ok

    def submit(self, reqs) -> None:
        for r in reqs:
            i = 0
            while i < len(self.script):
                n = self.rng.randint(1, 3)
                r.push(Event(self.script[i : i + n]))
                i += n
            r.push(Event([], "stop", self.llm.tokenizer.decode(self.script, skip_special=True)))


@pytest.fixture(scope="module")
def client(tiny_k25):
    tok = Tokenizer.from_dir(tiny_k25)
    with serving(create_app(ScriptedEngine(tiny_k25, tok, two_calls(tok)), MODEL)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


WANT = [
    ("functions.get_weather:0", "get_weather", '{"city": "Zürich"}'),
    ("functions.get_time:1", "get_time", "{}"),
]
REASONING, CONTENT = "let me think: é😀", "Sure."


@pytest.mark.parametrize("parallel", [None, False])
def test_whole_answer_has_reasoning_content_and_tool_calls(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(**ASK, tools=TOOLS, **extra)
    (ch,) = r.choices
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == CONTENT and ch.message.model_extra["reasoning_content"] == REASONING
    got = [(c.id, c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    assert got == WANT[: 1 if parallel is False else 2] and all(
        c.type == "function" for c in ch.message.tool_calls
    )


@pytest.mark.parametrize("parallel", [None, False])
def test_streamed_deltas_assemble_to_the_whole_answer(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    chunks = list(client.chat.completions.create(**ASK, tools=TOOLS, stream=True, **extra))
    reasoning, content, calls = "", "", {}
    for ch in chunks:
        d = ch.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for c in d.tool_calls or []:
            if c.id is not None:  # a call's first delta: id, type and name, once
                assert c.index not in calls and c.type == "function"
                calls[c.index] = [c.id, c.function.name, ""]
            calls[c.index][2] += c.function.arguments or ""
    assert (reasoning, content) == (REASONING, CONTENT)
    assert [tuple(calls[k]) for k in sorted(calls)] == WANT[: 1 if parallel is False else 2]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS, "tool_choice": "none"}])
def test_no_tools_declared_means_no_tool_calls(client, extra):
    """Without tools (or with tool_choice none) the markers are not read: the calls' text stays content."""
    (ch,) = client.chat.completions.create(**ASK, **extra).choices
    assert ch.finish_reason == "stop" and not ch.message.tool_calls
    assert ch.message.content.startswith(CONTENT + "functions.get_weather:0")


def test_an_sdk_assistant_message_replays_as_it_came(client):
    """A client appends the assistant message the SDK parsed (its empty fields included) and answers."""
    (ch,) = client.chat.completions.create(**ASK, tools=TOOLS).choices
    history = [*ASK["messages"], ch.message.model_dump()]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in ch.message.tool_calls]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert again.choices[0].finish_reason == "tool_calls"


def nested(depth: int) -> dict:
    x: dict = {}
    for _ in range(depth):
        x = {"a": x}
    return x


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(200)}}]}, "tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
            "tools[0].function.strict",
        ),
        # the conversation's largest part, refused before it is encoded (it was blamed on "messages")
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "w " * 150000}}]}, "tools"),
    ],
)
def test_odd_inputs_are_named_4xx_not_500(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{**ASK, **extra})
    assert e.value.body["param"] == param


def test_a_server_without_logprobs_graphs_refuses_logprobs_by_name(tiny_k25):
    tok = Tokenizer.from_dir(tiny_k25)
    engine = ScriptedEngine(tiny_k25, tok, two_calls(tok))
    engine.logprobs = False
    with serving(create_app(engine, MODEL)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="--no-logprobs") as e:
            c.chat.completions.create(**ASK, logprobs=True)
        assert e.value.body["param"] == "logprobs"
        assert c.chat.completions.create(**ASK).choices[0].finish_reason == "stop"  # no tools: plain text


def test_tokenize_builds_the_prompt_the_endpoints_build_and_detokenize_reads_it(tiny_k25):
    from k26.chat import ChatFormat, render

    tok = Tokenizer.from_dir(tiny_k25)
    with serving(create_app(ScriptedEngine(tiny_k25, tok, two_calls(tok)), MODEL)) as url:
        status, r = post(url, "/tokenize", {"model": MODEL, "prompt": "def main():"})
        assert status == 200 and r["tokens"] == tok.encode("def main():") and r["count"] == len(r["tokens"])
        chat = {"model": MODEL, "messages": ASK["messages"], "tools": TOOLS}
        status, r = post(url, "/tokenize", chat)
        assert r["tokens"] == render(tok, ASK["messages"], ChatFormat.for_model("kimi_k25"), TOOLS)
        status, r = post(url, "/detokenize", {"model": MODEL, "tokens": tok.encode("def main():")})
        assert (status, r["prompt"]) == (200, "def main():")
        for path, body, param in [
            ("/tokenize", {"model": MODEL}, "prompt"),
            ("/tokenize", {"model": MODEL, "prompt": "x", "messages": []}, "prompt"),
            ("/tokenize", {"model": MODEL, "prompt": "x", "tools": TOOLS}, "tools"),
            ("/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens[0]"),  # (the element, as prompt[i] is)
            ("/detokenize", {"model": MODEL, "tokens": [1, "a"]}, "tokens[1]"),
            ("/detokenize", {"model": MODEL, "tokens": 5}, "tokens"),
            ("/detokenize", {"model": "other", "tokens": [1]}, "model"),
        ]:
            status, r = post(url, path, body)
            assert status in (400, 404) and r["error"]["param"] == param


def test_an_api_key_guards_every_route_but_health_and_metrics(tiny_k25):
    tok = Tokenizer.from_dir(tiny_k25)
    with serving(create_app(ScriptedEngine(tiny_k25, tok, two_calls(tok)), MODEL, api_key="s3cret")) as url:
        for key, ok in [("wrong", False), ("s3cret", True)]:
            c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
            if ok:
                assert c.chat.completions.create(**ASK).choices[0].finish_reason == "stop"
                assert [m.id for m in c.models.list()] == [MODEL]
            else:
                with pytest.raises(openai.AuthenticationError):
                    c.chat.completions.create(**ASK)
        routes = [
            ("GET", "/v1/models", None),
            ("GET", f"/v1/models/{MODEL}", None),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", ASK),
            ("POST", "/tokenize", {"model": MODEL, "prompt": "x"}),
            ("POST", "/detokenize", {"model": MODEL, "tokens": [1]}),
        ]
        for method, path, body in routes:  # no key at all, and a wrong one
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                status, r = call(url, method, path, body, headers)
                assert status == 401 and r["error"]["code"] == "invalid_api_key", (method, path, headers)
        for path in ("/health", "/metrics"):
            with urllib.request.urlopen(url + path, timeout=10) as r:
                assert r.status == 200


def test_an_api_key_with_surrounding_whitespace_still_matches(tiny_k25, monkeypatch, capsys):
    """' s3cret\\n' (say, read from a key file) answered 401 to every client, whose header values are trimmed;
    a blank K26_API_KEY is refused before loading (it would have served with no key at all)."""
    from k26.__main__ import main

    tok = Tokenizer.from_dir(tiny_k25)
    with serving(
        create_app(ScriptedEngine(tiny_k25, tok, two_calls(tok)), MODEL, api_key=" s3cret\n")
    ) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list()] == [MODEL]
    monkeypatch.setenv("K26_API_KEY", "  ")
    assert main(["serve", "--model", str(tiny_k25), "--device", "cpu"]) == 2
    assert "K26_API_KEY in the environment is blank" in capsys.readouterr().err


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    return call(url, "POST", path, body)


def call(url: str, method: str, path: str, body: dict | None, headers: dict | None = None) -> tuple:
    data = None if body is None else json.dumps(body).encode()
    head = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url + path, data, head, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
