"""The Tinker service on loopback for tests, as the tandem-tinker Redis user, in front of a gateway."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from helpers.loopback import serve_app
from tandem.settings import GatewaySettings, RedisSettings, TinkerServiceSettings, TinkerSettings

API_KEY = "tinker-test-key"
"""The gateway's key as the service takes it; the SDK sends it as `tml-` + the key."""


@contextmanager
def tinker_service(redis_url: str, gateway_url: str, **section: object) -> Iterator[str]:
    """The service's base URL (SDK: `tinker.ServiceClient(base_url=URL, api_key="tml-" + API_KEY)`)."""
    from tandem_inference.tinker.app import create_tinker_app, gateway_client

    settings = TinkerSettings(redis=RedisSettings(url=redis_url), gateway=GatewaySettings(api_key=API_KEY),
                              tinker=TinkerServiceSettings(gateway_url=gateway_url, **section))
    conn = redis.Redis.from_url(redis_url)
    gateway = gateway_client(settings)
    try:
        with serve_app(create_tinker_app(settings, conn=conn, gateway=gateway)) as url:
            yield url
    finally:
        gateway.close()
        conn.close()
