"""The `metrics` profile on the CPU container stack: Prometheus, built from the base's own package,
scrapes every tandem service; its HTTP API answers for a metric of each."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from compose_stack import ComposeStack, started_stack, wait_for
from helpers.loopback import free_port

pytestmark = pytest.mark.e2e

PROMETHEUS_PORT = free_port()

#: One metric each service exports from its start, and the scrape job that reads it.
EXPORTED = {
    "gateway": "tandem_gateway_refused_total",
    "controller": "tandem_controller_malformed_events_total",  # on the gateway's /metrics
    "engine": "tandem_engine_loaded_adapters",
    "trainer": "tandem_trainer_queue_depth",
}
JOB_OF = {"gateway": "gateway", "controller": "gateway", "engine": "engine", "trainer": "trainer"}


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    yield from started_stack(request, tmp_path_factory, env=f"PROMETHEUS_PORT={PROMETHEUS_PORT}\n",
                             services=("redis", "engine", "inference", "trainer", "prometheus"),
                             profiles=("metrics",))


def query(expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query", params={"query": expr}, timeout=10)
    reply.raise_for_status()
    body = reply.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_prometheus_scrapes_every_service(stack: ComposeStack) -> None:
    wait_for(lambda: {r["metric"]["job"] for r in query("up == 1")} >= set(JOB_OF.values()), 120,
             "every scrape job to be up")
    for service, metric in EXPORTED.items():
        [sample] = query(metric) if service != "gateway" else query(f'{metric}{{reason="queue_full"}}')
        assert sample["metric"]["job"] == JOB_OF[service], (service, sample)
        assert float(sample["value"][1]) == 0, (service, sample)
    rules = httpx.get(f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/rules", timeout=10).json()
    alerts = {rule["name"] for group in rules["data"]["groups"] for rule in group["rules"]}
    assert {"TandemTrainerStuck", "TandemReplicaOutOfRotation", "TandemSyncSlow"} <= alerts


def test_prometheus_is_published_on_loopback_only(stack: ComposeStack) -> None:
    ports = stack.compose("port", "prometheus", "9090").stdout.strip()
    assert ports == f"127.0.0.1:{PROMETHEUS_PORT}"
    # The trainer's /metrics is on the compose network, not on the host.
    assert stack.compose("port", "trainer", "9310", check=False).stdout.strip() in ("", ":0")
