"""Servers on loopback for tests: a free port, and an ASGI app served by uvicorn in a thread.

`free_port` is the local stack's own (one way to pick a port in the whole project).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tandem.dev.stack import free_port

__all__ = ["free_port", "serve_app"]


@contextmanager
def serve_app(app: Any, *, port: int | None = None) -> Iterator[str]:
    """Run an ASGI app with uvicorn in a thread on loopback; yields its base URL."""
    import uvicorn

    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"server on port {port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
