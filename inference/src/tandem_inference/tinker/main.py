"""The Tinker service's entry point: `tandem-tinker` or `python -m tandem_inference.tinker`.

Reads TinkerSettings (TANDEM_TINKER__*, the gateway's API key, Redis as the tandem-tinker user),
refuses to listen beyond loopback without an API key, then serves the app with uvicorn.
"""

from __future__ import annotations

import ipaddress
import logging

from tandem.logs import configure
from tandem.settings import TinkerSettings

log = logging.getLogger(__name__)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main() -> None:
    import uvicorn

    from tandem_inference.tinker.app import create_tinker_app, gateway_client

    settings = TinkerSettings()
    configure()
    if settings.gateway.api_key is None and not _loopback(settings.tinker.host) \
            and not settings.gateway.allow_unauthenticated:
        raise SystemExit(f"tinker.host {settings.tinker.host!r} is beyond loopback and gateway.api_key is unset: set "
                         "TANDEM_GATEWAY__API_KEY (or gateway.allow_unauthenticated) before serving there")
    conn = settings.redis.connect()
    gateway = gateway_client(settings)
    app = create_tinker_app(settings, conn=conn, gateway=gateway)
    log.info("tinker.start host=%s port=%d gateway=%s", settings.tinker.host, settings.tinker.port,
             settings.tinker.gateway_url)
    try:
        uvicorn.run(app, host=settings.tinker.host, port=settings.tinker.port, log_config=None)
    finally:
        gateway.close()
        conn.close()


if __name__ == "__main__":
    main()
