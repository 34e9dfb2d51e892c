"""The transformers engine's HTTP server: the app factory and `main` (`tandem-engine`).

Its lifespan loads the model in a worker thread; the routes come from `routes_generate`,
`routes_openai`, `routes_admin` and `routes_info`. Every EngineError becomes its status in
SGLang's error shape (see replies.py), and validation problems a 422 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.routing import Route

from tandem import logs
from tandem.settings import EngineSettings
from tandem_inference.bodies import error_response, invalid_request
from tandem_inference.engines.transformers import routes_admin, routes_generate, routes_info, routes_openai
from tandem_inference.engines.transformers.bridge import Generations
from tandem_inference.engines.transformers.dependencies import ServerState
from tandem_inference.engines.transformers.metrics import EngineMetrics
from tandem_inference.engines.transformers.replies import error_body, status_of
from tandem_inference.engines.transformers.runtime import HFEngine
from tandem_inference.errors import EngineError

log = logging.getLogger(__name__)


def create_engine_app(settings: EngineSettings) -> FastAPI:
    """The engine as an ASGI app; its lifespan loads the model (in a worker thread)."""
    metrics = EngineMetrics()
    state = ServerState(
        settings=settings,
        metrics=metrics,
        generations=Generations(metrics, timeout_s=settings.generate_timeout_s),
        created=int(time.time()),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine = await asyncio.to_thread(
            HFEngine,
            settings.model,
            device=settings.device,
            max_lora_rank=settings.max_lora_rank,
            max_loaded_adapters=settings.max_loaded_adapters,
            allowed_targets=settings.lora_target_modules,
        )
        yield
        state.engine = None

    app = FastAPI(title="tandem transformers engine", lifespan=lifespan)
    app.state.server = state
    for module in (routes_generate, routes_openai, routes_admin, routes_info):
        app.include_router(module.router)
    app.middleware("http")(_count_requests)
    app.exception_handler(EngineError)(_engine_error)
    app.exception_handler(HTTPException)(_http_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    return app


async def _count_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    response = await call_next(request)
    route = request.scope.get("route")
    path = route.path if isinstance(route, Route) else "unmatched"
    metrics: EngineMetrics = request.app.state.server.metrics
    metrics.requests.labels(path, str(response.status_code)).inc()
    return response


async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
    status = status_of(exc)
    if status >= 500:
        log.error("request_failed path=%s error=%s", request.url.path, exc)
    return error_response(status, error_body(str(exc), status))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_response(exc.status_code, error_body(str(exc.detail), exc.status_code))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param, problems = invalid_request(exc, request.headers.get("content-type"))
    return error_response(422, {**error_body(message, 422, param), "detail": problems})


def main() -> None:
    """`tandem-engine`: parse settings, set up logging, then load the model and serve."""
    from tandem.errors import ConfigError
    from tandem.settings import InferenceSettings, load, service_arguments

    service_arguments("tandem-engine", "inference", "The transformers engine (the CPU stack's): serves the base "
                      "model and its LoRA adapters over HTTP for the inference service.")
    logs.configure()
    try:
        settings = load(InferenceSettings)
    except ConfigError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    log.info("engine_settings %s", json.dumps(settings.redacted()["engine"], default=str))
    import uvicorn
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    uvicorn.run(
        create_engine_app(settings.engine),
        host=settings.engine.host,
        port=settings.engine.port,
        log_config=None,  # tandem.logs' format and level
    )
