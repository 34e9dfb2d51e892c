"""The FastAPI app of the Tinker service: its `TinkerService`, routes, error replies and body limit.

Every path the routes do not serve (under /api/v1/ or not, any method) is answered in Tinker's
error shape naming the route and listing what tandem serves.
"""

from __future__ import annotations

import httpx
import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tandem.settings import TinkerSettings
from tandem_inference.tinker import routes
from tandem_inference.tinker.replies import TinkerBodyLimit, install_error_handlers, unsupported
from tandem_inference.tinker.service import TinkerService


def gateway_client(settings: TinkerSettings) -> httpx.Client:
    """The HTTP client to the gateway, with its API key (the caller closes it)."""
    key = settings.gateway.api_key
    return httpx.Client(base_url=settings.tinker.gateway_url,
                        timeout=httpx.Timeout(settings.tinker.sample_timeout_s, connect=10.0),
                        headers={"Authorization": f"Bearer {key.get_secret_value()}"} if key else {})


def create_tinker_app(settings: TinkerSettings, *, conn: redis.Redis, gateway: httpx.Client) -> FastAPI:
    """The app over Redis `conn` (as the tandem-tinker user) and `gateway`, both owned by the caller."""
    app = FastAPI(title="tandem tinker", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinker = TinkerService(settings, conn, gateway)
    install_error_handlers(app)
    app.add_middleware(TinkerBodyLimit, max_bytes=settings.tinker.max_body_bytes)
    app.include_router(routes.open_api)
    app.include_router(routes.api)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def _unsupported(request: Request) -> JSONResponse:
        return unsupported(request)

    return app
