"""The Tinker service's entry point: `tandem-tinker` or `python -m tandem_inference.tinker`.

Reads TinkerSettings (TANDEM_TINKER__*, the gateway's API key, Redis as the tandem-tinker user),
refuses to listen beyond loopback without an API key, then serves the app with uvicorn. A failure
tandem explains (Redis away, its credentials refused) is one log line and exit status 1.
"""

from __future__ import annotations

import ipaddress
import logging

from tandem.errors import TandemError
from tandem.logs import configure
from tandem.settings import TinkerSettings, load, service_arguments

log = logging.getLogger(__name__)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main() -> None:
    service_arguments("tandem-tinker", "tinker", "The Tinker-compatible training API: the tinker SDK and "
                      "tinker-cookbook train and sample through it.")
    configure()
    try:
        _serve(load(TinkerSettings))
    except TandemError as exc:
        log.error("tinker service stopped: %s", exc)
        raise SystemExit(1) from None


def _serve(settings: TinkerSettings) -> None:
    import uvicorn

    from tandem_inference.tinker.app import create_tinker_app, gateway_client

    # in a container the service binds 0.0.0.0 and the host publishes its port: that address counts
    host = settings.tinker.published_host or settings.tinker.host
    field = "tinker.published_host" if settings.tinker.published_host else "tinker.host"
    if settings.gateway.api_key is None and not _loopback(host) and not settings.gateway.allow_unauthenticated:
        raise SystemExit(f"{field} {host!r} is beyond loopback and gateway.api_key is unset: set "
                         "TANDEM_GATEWAY__API_KEY (GATEWAY_API_KEY in the compose .env), bind to 127.0.0.1, or "
                         "set TANDEM_GATEWAY__ALLOW_UNAUTHENTICATED=true before serving there")
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
