"""`python -m k26 serve`: an OpenAI-compatible HTTP server over one `LLM` with continuous batching.

protocol.py validates OpenAI requests, responses.py shapes the answers; engine.py is the thread that owns
the model and schedules rows at step boundaries; app.py is the FastAPI app the handlers live in.
"""

from __future__ import annotations

import socket

from .app import create_app
from .body import MAX_BODY_BYTES
from .engine import Engine
from .errors import APIError

__all__ = ["APIError", "Engine", "create_app", "run_server"]


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
    see `create_app`."""
    import uvicorn

    engine.start()
    try:
        config = uvicorn.Config(
            create_app(engine, model_name, api_key, max_body_bytes),
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=5,
        )
        uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)
    finally:
        engine.stop()
