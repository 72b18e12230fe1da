"""`python -m k26 serve`: an OpenAI-compatible HTTP server over one `LLM` with continuous batching.

protocol.py validates OpenAI requests, responses.py shapes the answers; engine.py is the thread that owns
the model and schedules rows at step boundaries; app.py is the FastAPI app the handlers live in.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time

from .app import create_app
from .body import MAX_BODY_BYTES
from .engine import Engine
from .errors import APIError

__all__ = ["APIError", "Engine", "create_app", "run_server"]

ANSWER_WAIT_S = 60.0  # at most this long for the engine's step to end and answer its requests at shutdown


async def wait_answered(engine: Engine, forced, limit: float = ANSWER_WAIT_S) -> None:
    """Until the engine's loop has ended (told to stop, it answers every request still running or waiting with
    a 503 at its next step boundary), at most `limit` seconds or until `forced()` (a second Ctrl-C). uvicorn's
    grace period then counts from there: a step longer than it (a prefill of several long prompts on a CPU)
    left the handlers cancelled mid-answer, their clients a cut stream or a plain-text 500."""
    deadline = time.monotonic() + limit
    while engine.thread.is_alive() and not forced() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def run_server(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    log_level: str = "info",
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> None:
    """Start the engine thread, then serve HTTP until interrupted (blocking); `api_key`, `max_body_bytes`:
    see `create_app`. SIGINT and SIGTERM shut down alike: the engine first (requests still running or
    waiting are answered 503 within the grace period, none cut off), then the HTTP server."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            engine.stop_soon()  # (uvicorn would otherwise cancel the handlers mid-answer after its grace)
            await wait_answered(engine, lambda: self.force_exit)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    # uvicorn re-raises a captured SIGTERM once it has shut down, which kills the process
                    # before the engine and the LLM (CUDA graphs, TP ranks) are closed: dropped here, so a
                    # terminated server exits as a stopped one does (SIGINT still ends in KeyboardInterrupt).
                    captured = getattr(self, "_captured_signals", [])
                    captured[:] = [sig for sig in captured if sig != signal.SIGTERM]

    engine.start()
    server = None
    try:
        config = uvicorn.Config(
            create_app(engine, model_name, api_key, max_body_bytes),
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=5,
        )
        server = Server(config)
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        engine.stop(0.0 if server is not None and server.force_exit else 30.0)  # (a second Ctrl-C: no wait)
