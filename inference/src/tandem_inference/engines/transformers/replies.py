"""How the engine answers errors and streams: SGLang's error shape, HTTP statuses, server-sent events.

Each EngineError class has its status (a bad request 400, no model to run 503); anything else
that escapes is a 500. Errors are `{"error": {message, type, param, code}}`: SGLang's shape,
OpenAI's fields. A stream that fails after it started ends with one such error event, then
`[DONE]`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from tandem_inference.errors import (
    AdapterLoadFailed,
    AdapterNotLoaded,
    EngineBusy,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    WeightsLoadFailed,
)

log = logging.getLogger(__name__)

_STATUS: dict[type[EngineError], int] = {
    InvalidRequest: 400,
    AdapterNotLoaded: 400,
    AdapterLoadFailed: 400,
    WeightsLoadFailed: 400,
    EngineUnavailable: 503,
    EngineBusy: 503,
}


def status_of(exc: Exception) -> int:
    """The HTTP status that answers `exc`."""
    return next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 500)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """SGLang's error shape, OpenAI's fields: `{"error": {message, type, param, code}}`."""
    kind = (
        "BadRequestError" if status < 500 else "ServiceUnavailableError" if status == 503 else "InternalError"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events of `events`; an error becomes one error event; `[DONE]` ends it."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.exception("stream failed")
            yield f"data: {json.dumps(error_body(str(exc), status_of(exc)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
