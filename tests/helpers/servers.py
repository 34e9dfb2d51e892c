"""The engine and the gateway on loopback, wired as the inference service wires them.

`gateway` builds the gateway as `tandem_inference.main` does (the engine's rollout and admin
calls in pools of their own), with the controller or without it (then it routes the base
model only). `engine_and_gateway` serves the tiny model's transformers engine behind one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import redis

from helpers.loopback import serve_app
from helpers.waiting import wait_until
from tandem.adapters import AdapterStore
from tandem.registry import Registry
from tandem.settings import (
    ControllerSettings,
    EngineSettings,
    GatewaySettings,
    InferenceSettings,
    RedisSettings,
    StoreSettings,
)
from tandem_inference.controller.service import Controller
from tandem_inference.engines.calls import ADMIN_CONNECTIONS, pool_limits
from tandem_inference.engines.transformers.client import TransformersEngine
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_inference.gateway.app import create_gateway_app
from tandem_inference.gateway.schemas import MAX_N
from tandem_inference.routing import RoutingTable

BASE = "base"  # the engine's served model name, the gateway's name of the base model


class Servers(NamedTuple):
    engine: str
    gateway: str


def inference_settings(redis_url: str, root: Path, engine_url: str, model: Path, *, limit: int = 64,
                       **gateway: Any) -> InferenceSettings:
    """The inference service's settings for tests: `limit` bounds max_tokens, `gateway` sets GatewaySettings."""
    return InferenceSettings(
        redis=RedisSettings(url=redis_url),
        store=StoreSettings(root=root),
        engine=EngineSettings(url=engine_url, model=str(model), served_model_name=BASE, max_new_tokens_limit=limit),
        controller=ControllerSettings(block_ms=50, keep_versions=2),
        gateway=GatewaySettings(**gateway),
    )


@contextmanager
def gateway(settings: InferenceSettings, tokenizer: Any, *, with_controller: bool = True) -> Iterator[str]:
    """Serve the gateway (and its controller) like main does; yields its URL once ready."""
    conn = redis.Redis.from_url(settings.redis.url)
    rollouts = httpx.AsyncClient(limits=pool_limits(max(settings.gateway.max_in_flight_sequences, MAX_N)))
    admin = httpx.AsyncClient(limits=pool_limits(ADMIN_CONNECTIONS))
    engine = TransformersEngine.from_settings(rollouts, settings.engine, admin_http=admin)
    table = RoutingTable(settings.engine.served_model_name)
    settings.store.root.mkdir(parents=True, exist_ok=True)
    controller = Controller(settings, conn, engine, AdapterStore(settings.store.root), table) if with_controller else None
    app = create_gateway_app(settings, engine=engine, table=table, tokenizer=tokenizer, registry=Registry(conn),
                             controller=controller)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> Any:  # as main does: the controller runs and the httpx clients close in its loop
        async with inner(a):
            if controller is not None:
                controller.start()
            try:
                yield
            finally:
                if controller is not None:
                    await controller.stop()
        await rollouts.aclose()
        await admin.aclose()

    app.router.lifespan_context = lifespan
    with serve_app(app) as url:
        if controller is not None:
            wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, what="gateway ready")
        yield url
    conn.close()


@contextmanager
def engine_and_gateway(tiny_model: Path, redis_url: str, root: Path, *, limit: int) -> Iterator[Servers]:
    """The transformers engine on the tiny model, and a gateway without a controller in front of it."""
    from transformers import AutoTokenizer

    engine_settings = EngineSettings(
        model=str(tiny_model), device="cpu", served_model_name=BASE, max_new_tokens_limit=limit,
        generate_timeout_s=60,
    )
    with serve_app(create_engine_app(engine_settings)) as engine_url:
        settings = inference_settings(redis_url, root, engine_url, tiny_model, limit=limit)
        with gateway(settings, AutoTokenizer.from_pretrained(tiny_model), with_controller=False) as gateway_url:
            yield Servers(engine_url, gateway_url)
