"""Replies in Tinker's error shape, for every refusal: `{"error", "category", "route", "param"}`
(what `RequestFailedResponse` carries, plus where and which field), never an HTML page.

An unknown route names itself and lists the routes tandem serves; a body that does not validate
names the field; Redis out of reach is a 503 (the SDK retries it). The statuses the SDK would
retry on its own (400, 409) are not used for refusals: a refusal is final. A run that is gone
(`RunNotFound`, a model deleted while a call was on its way) is a 404 like any deleted model's.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.errors import BackendUnavailable, RunNotFound
from tandem_inference.bodies import error_response
from tandem_inference.errors import TinkerRefusal, TinkerUnsupported
from tandem_inference.gateway.body_limit import BodyLimit

log = logging.getLogger(__name__)

#: The routes tandem serves, as an unsupported route's reply lists them.
SUPPORTED = (
    "GET /api/v1/healthz", "GET /api/v1/get_server_capabilities", "POST /api/v1/client/config",
    "POST /api/v1/client/dynamic_config", "POST /api/v1/create_session", "POST /api/v1/session_heartbeat",
    "POST /api/v1/sessions/{session_id}/finish",
    "POST /api/v1/telemetry", "POST /api/v1/create_model", "POST /api/v1/get_info",
    "POST /api/v1/forward_backward", "POST /api/v1/optim_step", "POST /api/v1/save_weights",
    "POST /api/v1/save_weights_for_sampler", "POST /api/v1/load_weights", "POST /api/v1/create_sampling_session",
    "GET /api/v1/samplers/{sampler_id}",
    "POST /api/v1/asample", "POST /api/v1/retrieve_future", "POST /api/v1/retrieve_futures",
)


def tinker_error(request: Request, status: int, message: str, *, category: str = "user", param: str | None = None,
                 **extra: Any) -> JSONResponse:
    route = f"{request.method} {request.url.path}"
    if status < 500:
        log.info("tinker.refused status=%d route=%s param=%s message=%s", status, route, param,
                 " ".join(message[:300].split()))
    return error_response(status, {"error": message, "category": category, "route": route, "param": param, **extra})


def unsupported(request: Request) -> JSONResponse:
    route = f"{request.method} {request.url.path}"
    return tinker_error(request, 404, f"{route} is not supported by tandem's Tinker service; it serves: "
                        f"{', '.join(SUPPORTED)} (docs/tinker.md)", supported=list(SUPPORTED))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TinkerRefusal)
    async def _refused(request: Request, exc: TinkerRefusal) -> JSONResponse:
        extra = {"supported": list(SUPPORTED)} if isinstance(exc, TinkerUnsupported) else {}
        status = exc.status_code if type(exc) is not TinkerRefusal else 503
        return tinker_error(request, status, str(exc), param=exc.param,
                            category="user" if status < 500 else "server", **extra)

    @app.exception_handler(RunNotFound)
    async def _run_gone(request: Request, exc: RunNotFound) -> JSONResponse:
        # the registry's message lists every run: not repeated to a caller who may own none of them
        return tinker_error(request, 404, "the run this call names is gone: its model was deleted (`tandem delete`) "
                            "while the call was on its way; create a new model")

    @app.exception_handler(BackendUnavailable)
    async def _redis(request: Request, exc: BackendUnavailable) -> JSONResponse:
        return tinker_error(request, 503, f"Redis is unavailable: {exc}", category="server")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("tinker.error route=%s %s", request.url.path, type(exc).__name__)
        return tinker_error(request, 500, f"internal error in tandem's Tinker service ({type(exc).__name__}: {exc}); "
                            "its log has the traceback", category="server")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        first = problems[0] if problems else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return tinker_error(request, 422, f"invalid request: {where}: {first.get('msg', 'does not validate')} "
                            f"({len(problems)} problem(s))", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):
            return unsupported(request)
        resp = tinker_error(request, exc.status_code, str(exc.detail))
        for name, value in (exc.headers or {}).items():
            resp.headers[name] = value
        return resp


class TinkerBodyLimit(BodyLimit):
    """The gateway's body limit, refusing in Tinker's shape."""

    def refusal(self, size: str) -> Any:
        return error_response(413, {"error": f"the request body is {size}, above the Tinker service's limit of "
                                    f"{self.max_bytes} bytes (tinker.max_body_bytes); send fewer datums per call",
                                    "category": "user", "param": "body"})
