"""The controller's Prometheus metrics: loads, rejections, timeouts, strays, unloads, evictions,
on-demand loads, serving versions."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ControllerMetrics:
    """Prometheus metrics of the controller, in a registry the caller owns (one per app)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.load_seconds = Histogram(
            "tandem_adapter_load_seconds", "Time the engine took to load one adapter version.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry,
        )
        self.loads = Counter("tandem_adapter_loads", "Adapter versions loaded.", ["run"], registry=registry)
        self.rejections = Counter("tandem_adapter_rejections",
                                  "Adapter versions refused (run '' for runs that are not registered).",
                                  ["run"], registry=registry)
        self.load_timeouts = Counter("tandem_adapter_load_timeouts",
                                     "Adapter loads the engine did not answer in time.", ["run"], registry=registry)
        self.strays = Counter("tandem_adapter_strays",
                              "Adapters found in the engine that nothing routes to (then unloaded).", ["run"],
                              registry=registry)
        self.unloads = Counter("tandem_adapter_unloads", "Unload attempts by outcome.", ["run", "outcome"],
                               registry=registry)
        self.evictions = Counter("tandem_adapter_evictions",
                                 ("Adapters taken out for room: the least recently used one no request held, or drained "
                                  "when every one served requests."),
                                 ["run"], registry=registry)
        self.on_demand_loads = Counter("tandem_adapter_on_demand_loads",
                                       "Versions loaded because a request asked for one the engine did not hold.",
                                       ["run"], registry=registry)
        self.serving = Gauge("tandem_serving_version", "Version each run is routed to (0 = base).", ["run"],
                             registry=registry)
        self.loaded = Gauge("tandem_loaded_versions", "Versions the engine holds per run.", ["run"],
                            registry=registry)
        self.malformed_events = Counter(
            "tandem_controller_malformed_events", "Stream entries skipped because they do not parse.",
            registry=registry,
        )
        self.ignored_claims = Counter(
            "tandem_replica_claims_ignored",
            "Other replicas' heartbeat claims to serve a version the registry does not have (forged or foreign).",
            registry=registry,
        )
        self.ready_to_serving_seconds = Histogram(
            "tandem_adapter_ready_to_serving_seconds",
            "Time from a version's `adapter_ready` (the trainer announced it) to this replica serving it.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=registry,
        )
        self.reconcile_seconds = Histogram(
            "tandem_controller_reconcile_seconds", "Time one reconciliation with the registry and engine took.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry,
        )
