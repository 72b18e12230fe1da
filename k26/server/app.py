"""The HTTP layer (FastAPI + uvicorn): OpenAI-compatible /v1/models, /v1/completions and
/v1/chat/completions (whole or streamed as server-sent events ending with `data: [DONE]`), /tokenize and
/detokenize, /health and /metrics (Prometheus text); with an API key (`RequireKey`) every route but the
last two wants it. Handlers validate, submit to the engine thread and await its events; a client that
disconnects cancels its request, which frees its row at the next step boundary.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..chat import ChatFormat
from .body import MAX_BODY_BYTES, read_json
from .chat_api import ChatStream, ChatTurn, message, read_whole
from .engine import Engine, EngineDown, Event, QueueFull, brief
from .engine import Request as EngineRequest
from .errors import APIError
from .json_values import short
from .logprobs import Logprobs, cut_at
from .metrics import prometheus
from .protocol import parse, prompt_ids, token_ids
from .responses import TextPieces, choice, completion_body, usage


@dataclass
class Served:
    """What the handlers share: the engine (and through it the LLM) and the model id clients send."""

    engine: Engine
    model: str
    max_body_bytes: int
    started: int = field(default_factory=lambda: int(time.time()))
    fmt: ChatFormat = field(init=False)  # the model's chat template (model_type)

    def __post_init__(self) -> None:
        llm = self.engine.llm
        self.fmt = ChatFormat.of_checkpoint(llm.path, llm.config.model_type)

    @property
    def llm(self):
        return self.engine.llm

    def stopping(self) -> bool:
        """The server is shutting down (a body still uploading is answered 503, not cancelled)."""
        return self.engine.stopping


def create_app(
    engine: Engine, model_name: str, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    """The app; with `api_key` every route but /health and /metrics wants `Authorization: Bearer <key>`;
    a request body above `max_body_bytes` is refused (413) before it is held."""
    # No schema or docs pages (the API is OpenAI's), and no 307 to the slash-less path: a client posting to
    # "/v1/completions/" gets the JSON 404 every unknown path gets, not a redirect without a body.
    app = FastAPI(title="k26", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    s = Served(engine, model_name, max_body_bytes)
    if api_key:
        app.add_middleware(RequireKey, key=api_key)

    _answer_errors(app)

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' probes)
    async def health(request: Request):
        if engine.error is not None or not engine.thread.is_alive():
            why = brief(engine.error) if engine.error is not None else "the engine has stopped"
            return JSONResponse({"status": "error", "error": why}, status_code=503)
        return Response(status_code=200) if request.method == "HEAD" else {"status": "ok"}

    def card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": s.started,
            "owned_by": "k26",
            "max_model_len": s.llm.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != model_name:
            raise APIError(
                404,
                f"model {short(model)} does not exist (this server serves {short(model_name)})",
                "model",
                code="model_not_found",
            )
        return card()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine.metrics), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(s, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(s, request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """A prompt's ids as /v1/completions (`prompt`) or /v1/chat/completions (`messages`, `tools`,
        `chat_template_kwargs`) would build them, with their count and the context they go into."""
        body = await read_json(request, s.max_body_bytes, s.stopping)
        llm = s.llm  # (tokenizing a long prompt in a worker thread: the other clients' streams go on)
        ids = await asyncio.to_thread(
            prompt_ids, body, llm.tokenizer, llm.config.vocab_size, s.fmt, model=s.model
        )
        return {"count": len(ids), "max_model_len": s.llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request, s.max_body_bytes, s.stopping)
        ids = token_ids(body, s.llm.config.vocab_size, model=s.model)
        return {"prompt": s.llm.tokenizer.decode(ids)}

    return app


def _answer_errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours (`APIError`), unknown routes, wrong methods (with their Allow
    header) and a bug of ours (500)."""

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        # (a full queue frees within steps: clients honouring Retry-After, OpenAI's among them, wait a second)
        return JSONResponse(
            e.body(), status_code=e.status, headers={"Retry-After": "1"} if e.status == 429 else None
        )

    @app.exception_handler(404)
    async def not_found(request: Request, _):
        return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}").body(), 404)

    @app.exception_handler(405)
    async def bad_method(request: Request, e):
        msg = f"{request.method} is not allowed on {request.url.path}"
        return JSONResponse(APIError(405, msg).body(), 405, headers=getattr(e, "headers", None))  # Allow

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        # A bug of ours: OpenAI's shape for the client; Starlette re-raises it after this answer, so the
        # server's log gets the traceback once.
        return JSONResponse(APIError(500, f"internal error: {e!r}", type="server_error").body(), 500)


class RequireKey:
    """Pure ASGI middleware: `Authorization: Bearer <key>` on every route but /health and /metrics (401
    otherwise). Not Starlette's BaseHTTPMiddleware, under which a whole answer's handler no longer sees its
    client leave (`request.is_disconnected`), so a dropped request would keep its row to the end."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app, key: str):
        self.app, self.key = app, key.strip().encode()  # (as the client's token: header values are trimmed)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = APIError(
                    401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key"
                )
                await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


async def generate(s: Served, request: Request, chat: bool):
    """Validate, queue for the engine (a row per choice), then answer whole or as a stream."""
    body = await read_json(request, s.max_body_bytes, s.stopping)
    llm = s.llm
    p = await asyncio.to_thread(  # (tokenizing in a worker thread: the other clients' streams go on)
        parse,
        body,
        chat=chat,
        model=s.model,
        tok=llm.tokenizer,
        vocab=llm.config.vocab_size,
        max_model_len=llm.max_model_len,
        fmt=s.fmt,
        logprobs=s.engine.logprobs,
    )
    rows = p.rows()
    if len(rows) > max(s.engine.max_waiting, 1):  # never all queued at once: 429's "retry later" won't help
        msg = (
            f"n={p.n} for {len(p.prompts)} prompt(s) is {len(rows)} rows, more than this server queues at "
            f"once (--max-waiting {s.engine.max_waiting})"
        )
        raise APIError(400, msg, "n" if p.n > 1 else "prompt")
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    a = Answer(
        [EngineRequest(ids, sp, loop, events, choice=i) for i, (ids, sp) in enumerate(rows)],
        events,
        f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        chat,
        sum(map(len, p.prompts)),  # each prompt counted once, however many choices it has (as OpenAI)
        p.include_usage,
        p.turn,
        p.echo,
        p.n,
    )
    try:
        s.engine.submit(a.reqs)
    except QueueFull as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
    except EngineDown as e:
        code = "server_shutting_down" if s.engine.stopping else "engine_down"
        raise APIError(503, str(e), type="server_error", code=code) from None
    if p.stream:
        return StreamingResponse(
            stream(s, a),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await whole(s, request, a)


@dataclass
class Answer:
    """One HTTP request's rows (a choice each: index = prompt * n + i) and how to answer them."""

    reqs: list[EngineRequest]
    events: asyncio.Queue  # every row's (choice, Event)
    rid: str
    chat: bool
    prompt_tokens: int
    include_usage: bool
    turn: ChatTurn | None  # chat: how to read each choice's output
    echo: bool = False  # completions: each choice's text begins with its prompt's
    n: int = 1  # choices per prompt
    created: int = field(default_factory=lambda: int(time.time()))

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancelled = True

    def logprobs(self, tok) -> list[Logprobs | None]:
        """Each choice's logprobs reader (None for a choice that did not ask)."""
        return [Logprobs(tok, self.chat) if r.params.logprobs is not None else None for r in self.reqs]

    def usage(self, completion: int, hits: list[int]) -> dict:
        """Usage; cached_tokens per prompt: what none of its choices prefilled (the first one prefills
        what the others copy), so that it never exceeds prompt_tokens."""
        cached = sum(min(hits[k : k + self.n]) for k in range(0, len(hits), self.n))
        return usage(self.prompt_tokens, completion, cached)

    def body(self, s: Served, choices: list[dict], use: dict | None, delta: bool = False) -> dict:
        out = completion_body(self.rid, s.model, self.chat, choices, use, delta, self.created)
        if delta and self.include_usage and use is None:
            out["usage"] = None  # OpenAI: with include_usage every chunk but the last says usage null
        return out


async def whole(s: Served, request: Request, a: Answer):
    """The whole answer once every choice finishes; a client gone meanwhile cancels them all."""
    ids: list[list[int]] = [[] for _ in a.reqs]
    hits = [0] * len(a.reqs)
    lps = a.logprobs(s.llm.tokenizer)
    last: list[Event | None] = [None] * len(a.reqs)
    echoed: list[tuple[str, dict | None]] = [("", None)] * len(a.reqs)
    clock = asyncio.get_running_loop().time
    check = clock() + 1.0  # a gone client is looked for once a second, events flowing or not
    try:
        while any(ev is None or ev.finish_reason is None for ev in last):
            try:
                i, ev = await asyncio.wait_for(a.events.get(), timeout=1.0)
            except TimeoutError:
                ev = None
            if clock() >= check:
                check = clock() + 1.0
                if await request.is_disconnected():
                    a.cancel()
                    return JSONResponse(APIError(499, "client closed the request").body(), 499)
            if ev is None:
                continue
            if ev.error is not None:
                a.cancel()
                raise ev.http_error()
            if a.echo and last[i] is None:
                echoed[i] = _echo(s, a, i, ev, lps[i])
            ids[i] += ev.token_ids
            hits[i] += ev.cached_tokens
            if lps[i] is not None:
                lps[i].push(ev.token_ids, ev.logprobs)
            last[i] = ev
    except asyncio.CancelledError:
        a.cancel()
        raise
    choices, tok = [], s.llm.tokenizer
    for i, (toks, ev, lp) in enumerate(zip(ids, last, lps)):
        logprobs = None if lp is None else lp.take(cut_at(lp.completion, ev.text)) or _NONE[a.chat]
        if a.turn is not None:
            out = read_whole(tok, a.turn, toks, ev.text)
            finish = out.finish_reason(ev.finish_reason, a.turn.limit)
            choices.append(choice(True, message(out, a.turn), finish, i, logprobs=logprobs))
            continue
        text = ev.text if ev.text is not None else tok.decode(toks, skip_special=True)
        prompt, plp = echoed[i]
        if plp is not None:
            logprobs = {k: plp[k] + logprobs[k] for k in logprobs}
        choices.append(choice(False, prompt + text, ev.finish_reason, i, logprobs=logprobs))
    return a.body(s, choices, a.usage(sum(map(len, ids)), hits))


async def stream(s: Served, a: Answer):
    """Server-sent chunks, one choice each: its increments (a completion's text in whole UTF-8 characters;
    a chat's reasoning, content and tool-call deltas), then its finish reason; usage if asked once every
    choice has finished, then `[DONE]`. However it ends (the client gone included), every choice is
    cancelled."""
    tok, n = s.llm.tokenizer, len(a.reqs)
    readers = [
        ChatStream(tok, a.turn, r.params.stop) if a.turn is not None else TextPieces(tok, r.params.stop)
        for r in a.reqs
    ]
    lps = a.logprobs(tok)
    tokens, hits, open_, seen = 0, [0] * n, n, [False] * n
    try:
        if a.chat:  # each choice's role comes first, as OpenAI's stream does
            for i in range(n):
                role = choice(True, {"role": "assistant", "content": ""}, None, i, delta=True)
                yield _sse(a.body(s, [role], None, delta=True))
        while open_:
            i, ev = await a.events.get()
            if ev.error is not None:
                yield _sse(ev.http_error().body())
                break
            tokens += len(ev.token_ids)
            hits[i] += ev.cached_tokens
            r, lp, done = readers[i], lps[i], ev.finish_reason is not None
            if a.echo and not seen[i]:  # the prompt first, with its tokens' logprobs
                text, obj = _echo(s, a, i, ev, lp)
                yield _sse(a.body(s, [choice(False, text, None, i, True, obj)], None, delta=True))
            seen[i] = True
            parts, taken, empty = r.push(ev.token_ids, ev.finish_reason, ev.text), None, {} if a.chat else ""
            if lp is not None:  # a token's logprobs go out with the text it begins in
                lp.push(ev.token_ids, ev.logprobs)
                taken = lp.take(cut_at(lp.completion, ev.text) if done else r.sent)
            if taken is not None and not parts and not done:
                parts = [empty]  # (tokens whose text is not whole characters yet, say)
            for k, part in enumerate(parts):
                chunk = choice(a.chat, part, None, i, True, taken if k == 0 else None)
                yield _sse(a.body(s, [chunk], None, delta=True))
            if done:
                end = choice(
                    a.chat, empty, r.finish_reason(ev.finish_reason), i, True, None if parts else taken
                )
                yield _sse(a.body(s, [end], None, delta=True))
                open_ -= 1
        else:
            if a.include_usage:
                yield _sse(a.body(s, [], a.usage(tokens, hits), delta=True))
        yield "data: [DONE]\n\n"
    finally:  # normal end, or the client went away (the response task is cancelled)
        a.cancel()


def _echo(s: Served, a: Answer, i: int, first: Event, lp: Logprobs | None) -> tuple[str, dict | None]:
    """Choice i's echoed prompt (completions' `echo`): its text and, with logprobs, its tokens' (the
    first event of the choice carries them)."""
    ids = a.reqs[i].prompt_ids
    if lp is None:
        return s.llm.tokenizer.decode(ids, skip_special=True), None
    return lp.echo(ids, first.prompt_logprobs), lp.take()  # (every prompt token: nothing else is pushed yet)


_NONE = {
    False: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
    True: {"content": []},
}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
