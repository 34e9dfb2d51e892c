"""Servers on loopback for tests: a free port, and an ASGI app served by uvicorn in a thread.

`free_port` is the local stack's own (one way to pick a port in the whole project).
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from helpers.waiting import wait_until
from tandem.dev.ports import free_port

__all__ = ["free_port", "held_stream_proxy", "serve_app", "served_process"]

HOP_BY_HOP = {"connection", "content-length", "keep-alive", "transfer-encoding"}


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


@contextmanager
def held_stream_proxy(target: str) -> Iterator[tuple[str, threading.Event]]:
    """A loopback HTTP proxy to `target` whose event streams stop after their first chunk until the event is set.

    A test that must look at a stream while it is certainly still running puts this between the
    gateway and the engine: the engine may finish at once, the stream the gateway sees may not.
    """
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    release = threading.Event()

    async def forward(request: Request) -> StreamingResponse:
        client = httpx.AsyncClient(base_url=target, timeout=60)
        upstream = await client.send(
            client.build_request(request.method, request.url.path, params=request.query_params,
                                 headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
                                 content=await request.body()),
            stream=True,
        )
        held = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def body() -> Any:
            try:
                first = True
                async for chunk in upstream.aiter_raw():
                    yield chunk
                    if held and first:
                        first = False
                        await asyncio.to_thread(release.wait, 60)
            finally:
                await upstream.aclose()
                await client.aclose()

        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=headers)

    methods = ["GET", "POST", "PUT", "DELETE"]
    with serve_app(Starlette(routes=[Route("/{path:path}", forward, methods=methods)])) as url:
        try:
            yield url, release
        finally:
            release.set()


@contextmanager
def served_process(argv: Sequence[str], log_path: Path, health_url: str, *, what: str, timeout_s: float = 60.0,
                   cwd: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A server process (output to `log_path`) once `health_url` answers 200; stopped when the block ends.

    A process that exits before it answers fails the wait at once, with the end of its log.
    """
    import httpx

    with log_path.open("wb") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
        try:
            def answers() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"{what} exited ({proc.returncode}): {log_path.read_text()[-4000:]}")
                return httpx.get(health_url, timeout=2).status_code == 200

            wait_until(answers, timeout_s, f"{what} to answer {health_url}", interval_s=0.2, ignoring=(httpx.HTTPError,))
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
