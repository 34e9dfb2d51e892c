"""An engine and a gateway on loopback for the tests of their HTTP surfaces.

The gateway runs without a controller, so it serves the base model only; `limit` bounds
`max_tokens` on both, which keeps generation short where tests send many requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from loopback import serve_app
from test_gateway import gateway

from tandem.settings import (
    ControllerSettings,
    EngineSettings,
    GatewaySettings,
    InferenceSettings,
    RedisSettings,
    StoreSettings,
)
from tandem_inference.engine_server import create_engine_app

BASE = "base"  # the engine's served model name, the gateway's name of the base model


class Servers(NamedTuple):
    engine: str
    gateway: str


@contextmanager
def engine_and_gateway(tiny_model: Path, redis_url: str, root: Path, *, limit: int) -> Iterator[Servers]:
    from transformers import AutoTokenizer

    engine_settings = EngineSettings(
        model=str(tiny_model), device="cpu", served_model_name=BASE, max_new_tokens_limit=limit,
        generate_timeout_s=60,
    )
    with serve_app(create_engine_app(engine_settings)) as engine_url:
        settings = InferenceSettings(
            redis=RedisSettings(url=redis_url),
            store=StoreSettings(root=root),
            engine=EngineSettings(url=engine_url, model=str(tiny_model), served_model_name=BASE,
                                  max_new_tokens_limit=limit),
            controller=ControllerSettings(block_ms=50),
            gateway=GatewaySettings(),
        )
        with gateway(settings, AutoTokenizer.from_pretrained(tiny_model), with_controller=False) as gateway_url:
            yield Servers(engine_url, gateway_url)
