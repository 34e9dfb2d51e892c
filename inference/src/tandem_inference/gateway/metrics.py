"""The gateway's Prometheus metrics: requests, latency, admission and clients that left.

Generation requests are counted by route, model and status and timed to their last byte (a
stream's too) by `MetricsMiddleware`; admission (queue depth, the oldest waiter's wait so far,
samples and tokens in flight) is read from the capacity at every scrape. A scrape without the
API key sees the runs' names opaque (`OpaqueRuns`; the /metrics route decides).
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import time
from collections.abc import Collection, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem_inference.gateway.capacity import Capacity
from tandem_inference.gateway.run_quota import RunQuotas
from tandem_inference.gateway.schemas import Kind

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
"""The routes that generate: the only ones counted, timed and admitted."""


def path_of(kind: Kind) -> str:
    """The route a request of `kind` came in by, as metrics label it."""
    return GENERATION_PATHS[0] if kind == "chat" else GENERATION_PATHS[1]


class GatewayMetrics:
    """The gateway's Prometheus metrics, in a registry the caller owns (one per app)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("tandem_gateway_requests", "Requests by route, model and status.",
                                ["route", "model", "status"], registry=registry)
        self.latency = Histogram("tandem_gateway_request_seconds", "Time to the end of the response.",
                                 ["route"],
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                 registry=registry)
        self.in_flight = Gauge("tandem_gateway_in_flight", "Generation requests in flight.",
                               registry=registry)
        self.queued = Gauge("tandem_gateway_queued_requests", "Generation requests waiting for room.",
                            registry=registry)
        self.in_flight_sequences = Gauge("tandem_gateway_in_flight_sequences",
                                         "Samples admitted to the engine (each request's n).", registry=registry)
        self.in_flight_tokens = Gauge("tandem_gateway_in_flight_tokens",
                                      "Tokens admitted to the engine (n * max_tokens of each request).",
                                      registry=registry)
        self.refused = Counter("tandem_gateway_refused", "Requests refused with 429, by reason.", ["reason"],
                               registry=registry)
        for reason in ("queue_full", "queue_timeout", "run_queue_full", "run_quota_timeout", "adapter_slots",
                       "run_adapter_slots", "adapter_load"):
            self.refused.labels(reason)
        self.run_queued = Gauge("tandem_gateway_run_queued_requests", "Generation requests waiting for a turn of "
                                "their run (beyond gateway.run_max_in_flight_sequences).", registry=registry)
        self.queue_oldest_wait = Gauge("tandem_gateway_queue_oldest_wait_seconds",
                                       "How long the oldest waiting generation request has waited so far (0: none "
                                       "waits); from half of gateway.queue_timeout_s on, it is overdue.",
                                       registry=registry)
        self.queue_wait = Histogram("tandem_gateway_queue_wait_seconds", "Time admitted requests waited for room.",
                                    buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300), registry=registry)
        self.cancelled = Counter("tandem_gateway_cancelled", "Requests whose client left before their end; "
                                 "their engine calls were closed.", ["route"], registry=registry)
        self.episode_turns = Counter("tandem_gateway_episode_turns", "Episode turns saved: an episode's "
                                     "first turn (`start`) or a later one (`continue`).", ["kind"], registry=registry)
        for kind in ("start", "continue"):
            self.episode_turns.labels(kind)

    def watch(self, capacity: Capacity, quotas: RunQuotas | None = None) -> None:
        """Read queue depth and admitted work from `capacity` (and the runs' lines from `quotas`) at every scrape."""
        if quotas is not None:
            self.run_queued.set_function(lambda: quotas.queued)
        self.queued.set_function(lambda: capacity.queued)
        self.queue_oldest_wait.set_function(lambda: capacity.oldest_wait_s)
        self.in_flight_sequences.set_function(lambda: capacity.sequences)
        self.in_flight_tokens.set_function(lambda: capacity.tokens)


RUN_LABELS = ("run", "model")
"""The labels whose values name runs: the controller's `run`, the requests' `model`."""


def opaque_run(name: str, key: str) -> str:
    """A run's name as a scrape without the API key sees it: the same on every replica and across
    restarts (keyed by the API key, so a guessed name cannot be checked against it without the key)."""
    return "run-" + hmac.new(key.encode(), name.encode(), hashlib.sha256).hexdigest()[:12]


class OpaqueRuns(Collector):
    """A registry's metrics with every run label's value made opaque; `keep`: values that name no
    run (the base model, `unknown`), shown as they are."""

    def __init__(self, registry: CollectorRegistry, key: str, keep: Collection[str]) -> None:
        self.registry = registry
        self.key = key
        self.keep = keep

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            opaque = copy.copy(family)
            opaque.samples = [sample._replace(labels={
                name: opaque_run(value, self.key) if name in RUN_LABELS and value not in self.keep else value
                for name, value in sample.labels.items()}) for sample in family.samples]
            yield opaque


class MetricsMiddleware:
    """Counts generation requests by status and times them to their last byte (streams too)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.monotonic()

        async def _send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, _send)
        finally:
            self.metrics.in_flight.dec()
            model = scope.get("state", {}).get("tandem_model", "unknown")
            self.metrics.requests.labels(scope["path"], model, str(status)).inc()
            self.metrics.latency.labels(scope["path"]).observe(time.monotonic() - t0)
