"""Error replies in OpenAI's shape, `{"error": {message, type, param, code}}`, for every failure.

A `model` that names nothing is a 404 listing the known names; a body that does not validate a
422 naming the field; an engine that cannot be reached (or is not ready) a 503; a generation the
engine refuses for what the client asked (a prompt longer than the context) a 400; any other
engine failure a 502. An episode turn that cannot go on is the status its error carries (404
unknown or expired, 409 not a continuation, 400 too long, 422 a request episodes do not take);
a run deleted while a job of it runs a 409 naming the job; Redis out of reach a 503. Replies
echo what the client sent, so they always serialize (bodies.py).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.errors import BackendUnavailable, RunBusy
from tandem_inference.bodies import error_response, invalid_request
from tandem_inference.errors import (
    AdapterMissing,
    EngineClientError,
    EngineResponseError,
    EngineUnreachable,
    ModelNotFound,
    RequestRefused,
)

log = logging.getLogger(__name__)


_URL = re.compile(r"https?://[^\s,;)'\"]+")
#: FastAPI's detail for a body its JSON parser raised on (bad UTF-8, recursion), which names neither.
UNPARSED = "There was an error parsing the body"


#: Seconds a client is told to wait when the engine lacks an adapter (a restarted engine's are
#: loaded again within a reconcile).
ADAPTER_RETRY_S = 2


def for_clients(exc: Exception) -> str:
    """An engine error's message as a client may read it: the engine's internal address left out
    (the gateway's log keeps it)."""
    return _URL.sub("<engine>", str(exc))


def error_reply(status: int, message: str, kind: str, *, param: str | None = None, **extra: Any) -> JSONResponse:
    """An OpenAI-shaped error reply, `{"error": {message, type, param, code}}`, that always serializes."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status, **extra}}
    return error_response(status, body)


def _refused_as_invalid(exc: EngineResponseError) -> bool:
    """Whether the engine refused a generation for what the client asked (a prompt longer than
    the context, ...): a 4xx about the request, not about an adapter it lacks (a server fault)."""
    return exc.status_code in (400, 413, 422) and not isinstance(exc, AdapterMissing)


def refused(request: Request, status: int, message: str, param: str | None = None) -> None:
    """One log line for a request the gateway refuses (the access line says only its status): where
    it went, what was wrong, the message cut to 300 characters, as one line whatever the client sent."""
    log.info("request.refused status=%d path=%s param=%s message=%s", status, request.url.path, param,
             " ".join(message[:300].split()))


def install_error_handlers(app: FastAPI) -> None:
    """Answer every tandem and HTTP error of `app` in OpenAI's error shape."""

    @app.exception_handler(ModelNotFound)
    async def _not_found(request: Request, exc: ModelNotFound) -> JSONResponse:
        refused(request, 404, str(exc), "model")
        return error_reply(404, str(exc), "model_not_found", param="model", known=exc.known)

    @app.exception_handler(RequestRefused)
    async def _refused(request: Request, exc: RequestRefused) -> JSONResponse:
        kind = {404: "not_found", 409: "conflict"}.get(exc.status_code, "invalid_request_error")
        refused(request, exc.status_code, str(exc), exc.param)
        return error_reply(exc.status_code, str(exc), kind, param=exc.param)

    @app.exception_handler(RunBusy)
    async def _busy(request: Request, exc: RunBusy) -> JSONResponse:
        refused(request, 409, str(exc), "run")
        return error_reply(409, str(exc), "conflict", param="run", job_id=exc.job_id)

    @app.exception_handler(BackendUnavailable)
    async def _redis(_: Request, exc: BackendUnavailable) -> JSONResponse:
        return error_reply(503, f"the episode store is unavailable: {exc}", "backend_unavailable")

    @app.exception_handler(EngineClientError)
    async def _engine(request: Request, exc: EngineClientError) -> JSONResponse:
        if isinstance(exc, EngineUnreachable):
            log.warning("engine unavailable: %s", exc)
            return error_reply(503, for_clients(exc), "engine_unavailable")
        if isinstance(exc, AdapterMissing):  # the engine restarted: the controller loads its adapters again
            log.warning("engine lacks an adapter the table routes to: %s", exc)
            resp = error_reply(503, "the engine does not hold this version's adapter right now (it restarted, and "
                               f"its adapters are being loaded again); retry in {ADAPTER_RETRY_S} s",
                               "engine_unavailable")
            resp.headers["Retry-After"] = str(ADAPTER_RETRY_S)
            return resp
        if isinstance(exc, EngineResponseError) and _refused_as_invalid(exc):
            refused(request, 400, f"refused by the engine: {exc.engine_message}")
            return error_reply(400, f"invalid request, refused by the engine: {exc.engine_message}",
                               "invalid_request_error")
        log.warning("engine error: %s", exc)
        return error_reply(502, for_clients(exc), "engine_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, problems = invalid_request(exc, request.headers.get("content-type"))
        refused(request, 422, message, param)
        return error_reply(422, message, "invalid_request_error", param=param, detail=problems)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found", 413: "invalid_request_error",
                422: "invalid_request_error"}.get(
            exc.status_code, "error")
        message = str(exc.detail)
        if exc.status_code == 400 and message == UNPARSED:  # starlette's words for any body json cannot read
            message = ("the body could not be read as JSON (not UTF-8, nested too deeply, or an integer of more "
                       "than 4300 digits); send one JSON "
                       "object, UTF-8, with Content-Type: application/json")
        resp = error_reply(exc.status_code, message, kind)
        for name, value in (exc.headers or {}).items():
            resp.headers[name] = value
        return resp
