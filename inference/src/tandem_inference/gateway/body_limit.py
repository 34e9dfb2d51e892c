"""A bound on request bodies: one request cannot hold the gateway (or its memory) with megabytes.

Pure ASGI middleware: a declared `Content-Length` above `gateway.max_body_bytes` is refused before
any byte is read; a body without one (chunked) is read up to the limit first, refused once it
passes it, else handed on whole. Either way the reply is an OpenAI-shaped 413 naming the limit
and the setting.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem_inference.gateway.error_replies import error_reply


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def refusal(self, size: str) -> Any:
        return error_reply(413, f"the request body is {size}, above the gateway's limit of {self.max_bytes} bytes "
                                "(gateway.max_body_bytes, TANDEM_GATEWAY__MAX_BODY_BYTES); send less, e.g. shorter "
                                "tool schemas or fewer messages", "invalid_request_error", param="body")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self.refusal(f"{int(declared)} bytes")(scope, receive, send)
            return
        if declared is not None:
            await self.app(scope, receive, send)
            return
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            more = bool(message.get("more_body", False))
            if seen > self.max_bytes:
                await self.refusal(f"more than {self.max_bytes} bytes")(scope, receive, send)
                return
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                      receive), send)


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    """A receive that gives `messages`, then asks `then` (a disconnect, while the reply streams)."""
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive
