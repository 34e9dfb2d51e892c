"""Paths with control characters are refused before routing.

Starlette's route patterns end in `$`, which in Python also matches just before a trailing
newline: `/v1/models/run%0A` answered for `run` (a `:path` parameter stops at the newline) and
`/v1/chat/completions%0A` was served as chat, though names are matched whole everywhere else (a
newline reaching response headers and logs is what that rule keeps out). Pure ASGI middleware: a
decoded path holding any character below 0x20 or 0x7f is a 404 naming it, cut to a readable
length, and logged.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem_inference.gateway.error_replies import error_reply

log = logging.getLogger(__name__)

SHOWN_CHARS = 120
"""How much of a refused path the reply repeats."""


class PlainPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", "")) if scope["type"] == "http" else ""
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
            shown = path if len(path) <= SHOWN_CHARS else path[:SHOWN_CHARS] + "..."
            log.info("refused a path with a control character: %r", shown)
            reply = error_reply(404, f"no route has a control character, as the path {shown!r} does; "
                                     "names of runs, versions and models are matched whole",
                                "not_found", param="path")
            await reply(scope, receive, send)
            return
        await self.app(scope, receive, send)
