"""The engine's Prometheus metrics, in a registry of their own so several apps can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem_inference.engines.transformers.sampling import Sequence


class EngineMetrics:
    """Requests by route and status, tokens in and out, adapter loads and full-weight reloads."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "tandem_engine_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter("tandem_engine_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("tandem_engine_generated_tokens", "Tokens generated", registry=r)
        self.adapter_load = Histogram(
            "tandem_engine_adapter_load_seconds",
            "Adapter load time in seconds",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.loaded_adapters = Gauge("tandem_engine_loaded_adapters", "Adapters loaded now", registry=r)
        self.weights_update = Histogram(
            "tandem_engine_weights_update_seconds",
            "Full-weight reload time (/update_weights_from_disk) in seconds",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )

    def count(self, seqs: list[Sequence]) -> None:
        """Count the tokens generated for `seqs`."""
        self.generated_tokens.inc(sum(len(s.output_ids) for s in seqs))
