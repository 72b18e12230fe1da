"""The server's HTTP layer around the engine: the body's size cap (413 before the bytes are held), parsing
off the event loop, a text prompt too long for the context refused before it is tokenized, the model card
route, 405 with its Allow header, HEAD /health, `usage: null` on the chunks of a stream that asked for usage,
an OpenAI-shaped 500 for a bug of ours, and the body's Unicode check on a deeply nested body."""

import asyncio
import http.client
import json
import time
import urllib.parse

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from http_app import serving
from served import MODEL, raw

import k26.server.app as app_module
from k26.server import create_app
from k26.server.body import unpaired_surrogate


def _request(url: str, method: str, path: str, body: bytes | None = None, headers=None):
    """(status, headers, body bytes) of one request, with exactly the headers given (no client defaults)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_a_body_above_the_cap_gets_413_and_one_below_is_served(served):
    with serving(create_app(served["engine"], MODEL, max_body_bytes=400)) as url:
        big = json.dumps({"model": MODEL, "prompt": "x" * 500, "max_tokens": 1}).encode()
        status, _, body = _request(url, "POST", "/v1/completions", big, {"Content-Type": "application/json"})
        assert status == 413 and "limit of 400" in json.loads(body)["error"]["message"]
        # no Content-Length (an iterable body goes chunked): the cap holds as the chunks arrive
        status, _, body = _request(
            url, "POST", "/v1/completions", iter([big[:300], big[300:]]), {"Content-Type": "application/json"}
        )
        assert status == 413, body
        small = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
        assert raw(url, "/v1/completions", small)[0] == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_declared_as_anything_but_json_gets_415(served, ctype):
    # (any Content-Type was parsed as JSON: a web page's form or text/plain POST, which browsers send to any
    # address without a CORS preflight, ran requests on a server without --api-key)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    status, _, out = _request(served["url"], "POST", "/v1/completions", body, {"Content-Type": ctype})
    assert status == 415 and ctype in json.loads(out)["error"]["message"]
    for ok in (
        {"Content-Type": "application/json; charset=utf-8"},
        {"Content-Type": "application/vnd.x+json"},
        {},
    ):
        assert _request(served["url"], "POST", "/v1/completions", body, ok)[0] == 200, ok


def test_a_stalled_body_gets_408_instead_of_holding_its_connection(served, monkeypatch):
    # (a body shorter than its Content-Length held the connection until the client gave up)
    import socket

    import k26.server.body as body_module

    monkeypatch.setattr(body_module, "BODY_STALL_S", 0.5)
    u = urllib.parse.urlsplit(served["url"])
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall((head + "Content-Length: 100\r\n\r\n" + '{"model": ').encode())
        reply = b""
        while b"stalled" not in reply and (part := sock.recv(65536)):
            reply += part
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408") and "stalled: nothing for 0.5 s after 10 bytes" in reply, reply


def test_a_trickling_body_gets_408_at_its_deadline(served, monkeypatch):
    # (a byte every few seconds, each within the stall limit, held a connection for as long as it liked)
    import socket

    import k26.server.body as body_module

    monkeypatch.setattr(body_module, "BODY_DEADLINE_S", 1.0)
    u = urllib.parse.urlsplit(served["url"])
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall((head + "Content-Length: 100\r\n\r\n").encode())
        sock.settimeout(0.2)
        reply, t0 = b"", time.monotonic()
        while b"uploading" not in reply and time.monotonic() - t0 < 20:
            try:
                sock.sendall(b" ")
                reply += sock.recv(65536)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                pass
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408") and "still uploading after 1 s (" in reply, reply


def test_a_body_still_uploading_at_shutdown_gets_503(served):
    # (a diff review: its handler waited in the body until uvicorn's grace ended, then was cancelled: a
    # plain-text 500 and a CancelledError traceback)
    import socket

    engine = served["engine"]
    u = urllib.parse.urlsplit(served["url"])
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall((head + "Content-Length: 100\r\n\r\n" + '{"model": ').encode())
        time.sleep(0.3)
        engine.stopping = True  # (what stop_soon sets; the shared engine itself goes on)
        try:
            reply = b""
            while b"shutting down" not in reply and (part := sock.recv(65536)):
                reply += part
        finally:
            engine.stopping = False
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 503") and "server_shutting_down" in reply, reply


def test_requests_are_parsed_where_no_event_loop_runs(served, monkeypatch):
    where = []

    def parse(*args, **kw):
        try:
            asyncio.get_running_loop()
            where.append("event loop")
        except RuntimeError:
            where.append("worker")
        return real(*args, **kw)

    real = app_module.parse
    monkeypatch.setattr(app_module, "parse", parse)
    body = json.dumps({"model": MODEL, "prompt": "def main(", "max_tokens": 2}).encode()
    assert raw(served["url"], "/v1/completions", body)[0] == 200
    assert where == ["worker"]


def test_a_text_prompt_longer_than_any_context_is_refused_before_it_is_encoded(served, monkeypatch):
    tok, max_len = served["llm"].tokenizer, served["llm"].max_model_len
    calls = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: calls.append(len(text)) or real(text))
    bound = (max_len - 1) * tok.max_token_bytes
    status, err = raw(
        served["url"], "/v1/completions", json.dumps({"model": MODEL, "prompt": "y" * (bound + 1)}).encode()
    )
    assert (
        status == 400
        and err["error"]["code"] == "context_length_exceeded"
        and err["error"]["param"] == "prompt"
    )
    assert calls == []
    # at the bound it may still fit: it is encoded, and refused by its token count
    status, err = raw(
        served["url"], "/v1/completions", json.dumps({"model": MODEL, "prompt": "y" * bound}).encode()
    )
    assert calls == [bound] and status == 400 and "tokens, but the context holds" in err["error"]["message"]


def test_chat_messages_longer_than_any_context_are_refused_before_they_are_rendered(served, monkeypatch):
    """(Found in a bug hunt: a 40 MB message was rendered and encoded — ~4 s of a worker — before its
    token count was refused; a completions prompt of that size is refused by its characters.)"""
    tok, max_len = served["llm"].tokenizer, served["llm"].max_model_len
    calls = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: calls.append(len(text)) or real(text))
    bound = (max_len - 1) * tok.max_token_bytes
    half = [{"role": "user", "content": "y" * (bound // 2)}, {"role": "assistant", "content": "n"}]
    body = {"model": MODEL, "messages": [*half, {"role": "user", "content": "y" * (bound - bound // 2)}]}
    status, err = raw(served["url"], "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    assert err["error"]["param"] == "messages" and calls == []  # contents summed over the messages
    # within the bound (which also counts each turn's markers and labels): rendered, then counted
    body["messages"] = [{"role": "user", "content": "y" * (bound // 2)}]
    status, err = raw(served["url"], "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and calls and "tokens, but the context holds" in err["error"]["message"]
    # the other text render always encodes counts too: a label, a tool call's arguments (found in review)
    calls.clear()
    call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "y" * bound}}
    for msg in (
        {"role": "user", "content": "hi", "name": "y" * (bound + 1)},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "q"}, msg]}
        status, err = raw(served["url"], "/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and err["error"]["code"] == "context_length_exceeded" and calls == [], msg


def test_a_path_with_a_trailing_slash_and_the_schema_page_are_json_404s_not_redirects(served):
    # (found in an audit: a bare 307 to the slash-less path; /openapi.json served the framework's schema)
    for path, data in (("/v1/completions/", b"{}"), ("/v1/models/", None), ("/openapi.json", None)):
        status, err = raw(served["url"], path, data)
        assert status == 404 and isinstance(err, dict) and err["error"]["message"], (path, err)


def test_the_model_card_route_answers_the_served_model_and_404_for_others(served):
    assert served["client"].models.retrieve(MODEL).id == MODEL
    status, err = raw(served["url"], "/v1/models/other-model")
    assert status == 404 and err["error"]["code"] == "model_not_found"


def test_405_names_the_allowed_methods_and_health_answers_head(served):
    status, headers, _ = _request(served["url"], "GET", "/v1/completions")
    assert status == 405 and headers.get("allow") == "POST"
    status, _, body = _request(served["url"], "HEAD", "/health")
    assert status == 200 and body == b""


def _chunks(url: str, body: dict) -> list[dict]:
    """A streamed completion's JSON chunks."""
    headers = {"Content-Type": "application/json"}
    _, _, data = _request(url, "POST", "/v1/completions", json.dumps(body).encode(), headers)
    return [json.loads(x[6:]) for x in data.decode().split("\n\n") if x.startswith("data: {")]


def test_stream_chunks_before_the_usage_chunk_say_usage_null(served):
    body = {"model": MODEL, "prompt": "def main(", "max_tokens": 4, "stream": True}
    chunks = _chunks(served["url"], body | {"stream_options": {"include_usage": True}})
    assert len(chunks) >= 2 and all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 4
    chunks = _chunks(served["url"], body)  # without include_usage, no chunk carries the key
    assert chunks and not any("usage" in c for c in chunks)


def test_a_bug_of_ours_answers_an_openai_shaped_500_and_the_server_goes_on(served, monkeypatch):
    def parse(*args, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(app_module, "parse", parse)
    status, err = raw(served["url"], "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode())
    assert status == 500 and err["error"]["type"] == "server_error" and "boom" in err["error"]["message"]
    assert raw(served["url"], "/health")[0] == 200


def test_the_unicode_check_walks_a_body_deeper_than_the_recursion_limit():
    deep: list = ["ok"]
    for _ in range(50_000):
        deep = [deep]
    assert unpaired_surrogate({"a": deep}) is None
    bottom: list = ["ok", "\ud800"]  # the same depth with a lone surrogate at the bottom: found and named
    for _ in range(50_000):
        bottom = [bottom]
    assert unpaired_surrogate({"a": bottom}) == "a" + "[0]" * 50_000 + "[1]"
    assert unpaired_surrogate({"a": ["x", {"b": ["y", "\ud800"]}], "c": "\udc00"}) == "a[1].b[1]"
    assert unpaired_surrogate({"\ud800": 1}) == "\ud800"


def test_a_key_holding_a_lone_surrogate_is_a_400_naming_it_escaped(served):
    status, err = raw(served["url"], "/v1/completions", b'{"model": "k26-test", "prompt": "x", "\\ud800": 1}')
    assert status == 400 and err["error"]["param"] == "\\ud800"  # (as text: the bare one cannot be sent)


def test_the_surrogate_check_walks_only_bodies_with_such_an_escape(monkeypatch):
    from k26.server import body

    walked = []
    monkeypatch.setattr(body, "unpaired_surrogate", lambda x: walked.append(1))
    assert body.parse_json(b'{"prompt": [1, 2, 3], "stop": "\\n"}') == {"prompt": [1, 2, 3], "stop": "\n"}
    assert walked == []
    body.parse_json(b'{"prompt": "\\ud83d\\ude00"}')  # (a pair: walked, and found whole)
    assert walked == [1]


def test_a_token_id_prompt_too_long_is_refused_by_its_length_before_its_ids_are_read(served):
    n = served["llm"].max_model_len
    ids = [5] * (n - 1) + [10**9]  # (its last id is outside the vocabulary: never looked at)
    status, err = raw(served["url"], "/v1/completions", json.dumps({"model": MODEL, "prompt": ids}).encode())
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    assert f"{n} tokens, but the context holds {n}" in err["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_client_gone_while_its_body_arrives_is_no_server_error(served, path):
    """The body cut short by the client leaving (Starlette's ClientDisconnect): answered as the client's
    doing (499), not a 500 whose traceback the server logs."""
    app, sent = create_app(served["engine"], MODEL), []
    messages = [{"type": "http.request", "body": b'{"model": "k26-te', "more_body": True}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))  # (a 500 re-raises its exception here, for the server's log)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499


def test_stream_null_is_the_default_a_whole_answer(served):
    """OpenAI's `stream` is "boolean or null" (default false), as the SDK sends it for stream=None; it was a
    400 ('stream=None: expected true or false') while every other nullable field took null."""
    c = served["client"]
    r = c.completions.create(model=MODEL, prompt="def main(", max_tokens=3, temperature=0, stream=None)
    assert r.object == "text_completion" and r.usage.completion_tokens == 3
    ask = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=3, temperature=0, stream=None)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("model", [None, 5, ["k26-test"]])
def test_a_model_null_or_not_a_string_is_a_400_not_model_not_found(served, path, model):
    """A missing (null) or mistyped model is the request's own error (400 naming model), not a 404
    'the model None does not exist' with code model_not_found (what a well-formed unknown name gets)."""
    body = {"model": model, "prompt": "x"} if path == "/v1/completions" else {"model": model, "messages": []}
    status, err = raw(served["url"], path, json.dumps(body).encode())
    assert status == 400 and err["error"]["param"] == "model" and err["error"]["code"] is None
    assert err["error"]["type"] == "invalid_request_error"


def test_serve_names_a_world_size_that_is_no_count(monkeypatch):
    # (serve read WORLD_SIZE with int(): 'abc' gave "invalid literal for int() with base 10: 'abc'")
    from k26.cli_parser import build_parser
    from k26.server.cli import check_args

    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(ValueError, match=r"WORLD_SIZE='abc' in the environment: expected an integer >= 1"):
        check_args(build_parser().parse_args(["serve"]))
