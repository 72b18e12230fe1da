"""An ASGI app served by uvicorn on a free loopback port in a thread, for the server tests."""

import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def serving(app):
    """Yields the base URL ("http://127.0.0.1:PORT") while `app` serves; stops it afterwards."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
