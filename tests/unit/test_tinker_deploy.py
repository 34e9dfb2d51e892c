"""The Tinker service in compose (compose.yaml's `tinker`, behind `--profile tinker`): published on
the host's loopback as the gateway is, with the gateway's key, Redis as the tandem-tinker user, the
gateway at its compose address, and a healthcheck on a route the service serves; nothing else waits
for it. And the service's own check: beyond loopback, counting the address compose publishes it on,
it refuses to start without the gateway's key. (Kubernetes: test_k8s_manifests.py.)
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from helpers.compose_yaml import services

from tandem.errors import TandemError
from tandem.settings import GatewaySettings, RedisSettings, TinkerServiceSettings, TinkerSettings
from tandem_inference.tinker import main as tinker_main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def default(value: str) -> str:
    """A compose value as it reads with no .env (`${X:-d}` is d)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_the_tinker_service_is_opt_in_and_nothing_waits_for_it() -> None:
    for name in ("compose.yaml", "compose.cpu.yaml", "compose.client.yaml", "compose.replicas.yaml"):
        for service_name, service in services(name).items():
            assert "tinker" not in ((service or {}).get("depends_on") or {}), (name, service_name)
    assert services("compose.yaml")["tinker"]["profiles"] == ["tinker"]


def test_the_tinker_service_publishes_one_port_on_loopback_as_the_gateway_does() -> None:
    tinker, inference = services("compose.yaml")["tinker"], services("compose.yaml")["inference"]
    assert tinker["ports"] == ["${TINKER_BIND:-127.0.0.1}:${TINKER_PORT:-8100}:8100"]
    assert [default(p) for p in tinker["ports"]] == ["127.0.0.1:8100:8100"]
    env = tinker["environment"]
    assert (env["TANDEM_TINKER__HOST"], env["TANDEM_TINKER__PORT"]) == ("0.0.0.0", "8100")
    # the check for serving beyond loopback reads the address the port is published on
    assert env["TANDEM_TINKER__PUBLISHED_HOST"] == "${TINKER_BIND:-127.0.0.1}"
    # the gateway's key and its exposure switch, as the gateway takes them
    for name in ("TANDEM_GATEWAY__API_KEY", "TANDEM_GATEWAY__ALLOW_UNAUTHENTICATED"):
        assert env[name] == inference["environment"][name], name


def test_the_tinker_service_reaches_the_gateway_and_redis_as_its_own_user() -> None:
    compose = services("compose.yaml")
    env = compose["tinker"]["environment"]
    assert env["TANDEM_TINKER__GATEWAY_URL"] == "http://inference:8000"
    assert compose["inference"]["environment"]["TANDEM_GATEWAY__PORT"] == "8000"
    assert re.fullmatch(r"redis://tandem-tinker:\$\{REDIS_TINKER_PASSWORD:\?[^}]*\}@redis:6379/0",
                        env["TANDEM_REDIS__URL"])
    assert compose["tinker"]["depends_on"] == {"redis": {"condition": "service_healthy"}}


def test_behind_the_router_the_tinker_service_samples_through_it() -> None:
    """compose.replicas.yaml: the replicas are no longer one gateway; the router is, on the gateway's port."""
    replicas = services("compose.replicas.yaml")
    assert replicas["tinker"]["environment"]["TANDEM_TINKER__GATEWAY_URL"] == "http://router:8000"
    assert [p.rsplit(":", 1)[-1] for p in replicas["router"]["ports"]] == ["8000"]
    assert set(replicas["tinker"]) == {"environment"}  # profile, image and the rest: compose.yaml's


def test_the_tinker_service_runs_from_the_cpu_inference_image_on_either_stack() -> None:
    """The SGLang and vLLM images lack the `tinker` package the service imports; the CPU image's lock has it."""
    tinker, cpu_engine = services("compose.yaml")["tinker"], services("compose.cpu.yaml")["engine"]
    assert tinker["image"] == cpu_engine["image"]
    assert tinker["build"]["dockerfile"] == cpu_engine["build"]["dockerfile"] == "images/inference-cpu.Dockerfile"
    assert "tinker" not in services("compose.cpu.yaml")  # the same service on the CPU stack
    locks = ROOT / "images" / "locks"
    assert re.search(r"^tinker==", (locks / "cpu-inference.txt").read_text(), re.M)
    assert tinker["command"] == ["python", "-m", "tandem_inference.tinker"]


def test_the_tinker_healthcheck_asks_a_route_the_service_answers_without_a_key() -> None:
    from fastapi import FastAPI

    from tandem_inference.tinker.routes import open_api

    test = services("compose.yaml")["tinker"]["healthcheck"]["test"]
    url = re.search(r"'(http://127\.0\.0\.1:8100(/[^']*))'", test[-1])
    assert url, test
    app = FastAPI()
    app.include_router(open_api)
    assert TestClient(app).get(url[2]).status_code == 200


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(("host", "published", "refused"), [
    ("127.0.0.1", None, False),
    ("0.0.0.0", "127.0.0.1", False),  # compose's default: published on the host's loopback
    ("0.0.0.0", None, True),
    ("0.0.0.0", "0.0.0.0", True),  # TINKER_BIND beyond loopback
    ("127.0.0.1", "192.0.2.7", True),
])
def test_beyond_loopback_without_the_gateways_key_the_service_refuses_to_start(
    host: str, published: str | None, refused: bool,
) -> None:
    """Refused: it stops with a message naming the address, before it opens Redis. Let through: it goes on
    to Redis, which (nothing listening here) stops it with Redis's own error instead."""
    redis_settings = RedisSettings(url=f"redis://127.0.0.1:{closed_port()}/0")
    tinker = TinkerServiceSettings(host=host, published_host=published)

    def serve(api_key: str | None) -> BaseException:
        settings = TinkerSettings(tinker=tinker, gateway=GatewaySettings(api_key=api_key), redis=redis_settings)
        with pytest.raises((SystemExit, TandemError)) as exc:
            tinker_main._serve(settings)
        return exc.value

    stopped = serve(None)
    if refused:
        assert isinstance(stopped, SystemExit), stopped
        assert "gateway.api_key is unset" in str(stopped) and repr(published or host) in str(stopped)
    else:
        assert isinstance(stopped, TandemError), stopped
    assert isinstance(serve("k" * 32), TandemError)  # with the key it goes on, wherever it listens
