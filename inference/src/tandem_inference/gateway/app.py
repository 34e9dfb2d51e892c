"""The FastAPI app of one gateway: its `Gateway`, routes, error replies and metrics middleware.

The app serves and starts nothing: no lifespan of its own. The inference service
(tandem_inference.main) starts the engine, the controller and the background loops before it
serves the app, and stops them after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from tandem.registry import Registry
from tandem.settings import InferenceSettings
from tandem_inference.controller.gpu_sharing import Admission
from tandem_inference.engines.base import Engine
from tandem_inference.gateway import routes
from tandem_inference.gateway.body_limit import BodyLimit
from tandem_inference.gateway.error_replies import install_error_handlers
from tandem_inference.gateway.metrics import GatewayMetrics, MetricsMiddleware
from tandem_inference.gateway.plain_path import PlainPath
from tandem_inference.gateway.service import Gateway
from tandem_inference.routing import RoutingTable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tandem_inference.controller.service import Controller


def create_gateway_app(
    settings: InferenceSettings,
    *,
    engine: Engine,
    table: RoutingTable,
    tokenizer: PreTrainedTokenizerBase,
    registry: Registry,
    controller: Controller | None = None,
    metrics: CollectorRegistry | None = None,
    admission: Admission | None = None,
) -> FastAPI:
    """The gateway app over `engine` and `table`.

    `engine` wraps the process's httpx clients (generation and admin pools), which the caller
    owns and closes. `controller`, run by the caller, is asked for readiness (/ready waits for
    its first reconciliation) and its metrics; None serves the base model and registered runs
    as the table has them. `metrics` is the Prometheus registry /metrics serves (a fresh one if
    None); the controller's registry is served too when it is another one. `admission` holds
    requests while the GPU is lent out (shared mode).
    """
    gateway_metrics = GatewayMetrics(metrics if metrics is not None else CollectorRegistry())
    # with an API key, no /docs, /redoc or /openapi.json: FastAPI serves them without it
    open_schema = settings.gateway.api_key is None
    app = FastAPI(title="tandem gateway", docs_url="/docs" if open_schema else None,
                  redoc_url="/redoc" if open_schema else None, openapi_url="/openapi.json" if open_schema else None)
    app.state.gateway = Gateway(settings, engine, table, tokenizer, registry, controller, admission, gateway_metrics)
    install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, metrics=gateway_metrics)
    app.add_middleware(BodyLimit, max_bytes=settings.gateway.max_body_bytes)  # before any parsing
    app.add_middleware(PlainPath)  # outermost: before routing
    for router in (routes.generation, routes.runs, routes.operations):
        app.include_router(router)
    return app
