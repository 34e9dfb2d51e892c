"""The gateway relays its engine's own metrics on /metrics/engine: the tiny model's transformers
engine and the gateway on loopback; an engine that is gone, and one that answers too much."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.loopback import free_port, serve_app
from helpers.servers import BASE, Servers, gateway, inference_settings
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tandem_inference.engines.calls import METRICS_MAX_BYTES

pytestmark = pytest.mark.integration

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_the_engines_own_metrics_are_relayed_without_a_key(
    servers: Servers, redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any
) -> None:
    done = httpx.post(f"{servers.gateway}/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 3},
                      timeout=60)
    assert done.status_code == 200
    generated = done.json()["usage"]["completion_tokens"]

    relayed = httpx.get(f"{servers.gateway}/metrics/engine", timeout=30)
    assert relayed.status_code == 200 and relayed.headers["content-type"] == PROMETHEUS_TEXT
    got = families(relayed.text)
    assert set(got) == set(families(httpx.get(f"{servers.engine}/metrics", timeout=30).text))  # the engine's own
    assert {"tandem_engine_requests", "tandem_engine_generated_tokens", "tandem_engine_loaded_adapters"} <= set(got)
    [total] = [s for s in got["tandem_engine_generated_tokens"].samples if s.name.endswith("_total")]
    assert total.value >= generated > 0
    assert "tandem_gateway_requests" not in got  # the gateway's own stay on /metrics

    # like /metrics, no key: numbers only
    keyed = inference_settings(redis_url, tmp_path / "store", servers.engine, tiny_model, api_key="secret-key")
    with gateway(keyed, tokenizer, with_controller=False) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/metrics/engine", timeout=30).status_code == 200


def test_an_engine_out_of_reach_is_a_503_naming_the_cause(
    redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any
) -> None:
    dead = inference_settings(redis_url, tmp_path / "store", f"http://127.0.0.1:{free_port()}", tiny_model)
    with gateway(dead, tokenizer, with_controller=False) as url:
        reply = httpx.get(f"{url}/metrics/engine", timeout=30)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["type"] == "engine_unavailable" and error["code"] == 503
    assert "cannot be reached for the metrics" in error["message"] and "ConnectError" in error["message"]
    assert "127.0.0.1" not in reply.text  # the engine's address stays inside


@pytest.fixture
def misbehaving_engine() -> Iterator[str]:
    """An engine whose /metrics runs to twice the bound, and whose /health answers."""
    chunk = b'sglang:num_running_reqs{model_name="base"} 1.0\n' * 4096

    async def too_long(request: Request) -> StreamingResponse:
        async def lines() -> Any:
            for _ in range(2 * METRICS_MAX_BYTES // len(chunk) + 1):
                yield chunk

        return StreamingResponse(lines(), media_type=PROMETHEUS_TEXT)

    async def health(request: Request) -> Response:
        return Response("ok")

    with serve_app(Starlette(routes=[Route("/metrics", too_long), Route("/health", health)])) as url:
        yield url


def test_an_engine_that_answers_too_much_is_a_502_and_the_gateway_serves_on(
    misbehaving_engine: str, redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any
) -> None:
    settings = inference_settings(redis_url, tmp_path / "store", misbehaving_engine, tiny_model)
    with gateway(settings, tokenizer, with_controller=False) as url:
        reply = httpx.get(f"{url}/metrics/engine", timeout=30)
        assert reply.status_code == 502
        error = reply.json()["error"]
        assert error["type"] == "engine_error" and f"more than {METRICS_MAX_BYTES} bytes" in error["message"]
        assert httpx.get(f"{url}/health").status_code == 200
