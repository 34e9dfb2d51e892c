"""`tandem.dev.metrics.metric`, what the bench and the tests read a service's /metrics with: a
real Prometheus page served on loopback by prometheus_client itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from tandem.dev.metrics import metric


@pytest.fixture
def page() -> Iterator[str]:
    registry = CollectorRegistry()
    refused = Counter("refused", "refused requests", ["reason", "route"], registry=registry)
    refused.labels("queue_full", "/v1/completions").inc(3)
    refused.labels("queue_full", "/v1/chat/completions").inc(2)
    refused.labels("queue_timeout", "/v1/completions").inc()
    Gauge("queued", "queued requests", registry=registry).set(7)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_samples_sum_over_the_labels_not_given(page: str) -> None:
    assert metric(page, "refused_total") == 6
    assert metric(page, "refused_total", reason="queue_full") == 5
    assert metric(page, "refused_total", reason="queue_full", route="/v1/completions") == 3
    assert metric(page, "queued") == 7


def test_what_is_not_on_the_page_reads_zero(page: str) -> None:
    assert metric(page, "refused_total", reason="no_such_reason") == 0
    assert metric(page, "refused") == 0  # a counter's samples are named with `_total`
    assert metric(page, "missing") == 0
