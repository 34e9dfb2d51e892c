"""Reading a service's Prometheus page (`/metrics`): what the bench and the tests count with."""

from __future__ import annotations

import httpx


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` on `url`'s /metrics whose labels include `labels`
    (0 when there is none): `metric(url, "tandem_gateway_refused_total", reason="queue_full")`.

    A counter's samples are named with their `_total`, as the page writes them."""
    # prometheus_client comes with the services (inference, trainer), not with the client package
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())
