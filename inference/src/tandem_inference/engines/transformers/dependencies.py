"""What the engine's routes share, handed to them as FastAPI dependencies.

`ServerState` lives on `app.state.server`: the settings, the metrics, the running generations
and the runtime once the lifespan has loaded it. `Engine` refuses (503) until then; `admin`
guards every admin route (see `routes_admin`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.exceptions import HTTPException

from tandem.settings import EngineSettings
from tandem_inference.bodies import is_loopback
from tandem_inference.engines.transformers.bridge import Generations
from tandem_inference.engines.transformers.metrics import EngineMetrics
from tandem_inference.engines.transformers.runtime import HFEngine
from tandem_inference.errors import EngineUnavailable


@dataclass
class ServerState:
    """What every route of one engine app shares."""

    settings: EngineSettings
    metrics: EngineMetrics
    generations: Generations
    created: int
    """When the app was made, in Unix seconds (OpenAI's `created` of /v1/models)."""
    engine: HFEngine | None = None
    """The runtime, once the lifespan has loaded the model."""


async def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


State = Annotated[ServerState, Depends(server_state)]


async def loaded_engine(state: State) -> HFEngine:
    if state.engine is None:
        raise EngineUnavailable("the model is not loaded yet; poll GET /health")
    return state.engine


Engine = Annotated[HFEngine, Depends(loaded_engine)]


async def admin(request: Request, state: State) -> None:
    """Admin routes load files and free memory: they need the admin key, or without one a
    client on loopback (the engine is private, but its network may not be)."""
    secret = state.settings.admin_api_key
    key = secret.get_secret_value() if secret is not None else ""
    if not key:
        peer = request.client.host if request.client else ""
        if not is_loopback(peer):
            raise HTTPException(
                403, f"admin route called from {peer or 'an unknown address'}; without an admin key "
                "(TANDEM_ENGINE__ADMIN_API_KEY) the engine answers admin routes on loopback only",
            )
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(given.encode(), key.encode()):
        raise HTTPException(
            401, "admin route: send the admin key as `Authorization: Bearer KEY` or `x-api-key: KEY`"
        )
