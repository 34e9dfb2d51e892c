"""What the controller tells Redis: `adapter_held`, `adapter_loaded` and `adapter_rejected`, each run's status,
load attempts.

Clients wait on these (a synchronous `train()` returns on `adapter_loaded`), `tandem status`
and the gateway's /v1/runs read the run status, and the attempt count keeps adapter names
unique across controller restarts. Every write goes through the registry or the event stream,
so every Redis error arrives as `BackendUnavailable`, naming the Redis URL.
"""

from __future__ import annotations

from tandem.adapters import Manifest
from tandem.events import Event, EventKind, EventStream, entry_order
from tandem.registry import Registry
from tandem_inference.controller.metrics import ControllerMetrics
from tandem_inference.routing import RoutingTable


class Announcer:
    """The controller's writes to Redis (and the gauges that mirror a run's status)."""

    def __init__(self, registry: Registry, events: EventStream, table: RoutingTable,
                 metrics: ControllerMetrics, *, replica: str = "") -> None:
        self.registry = registry
        self.replica = replica
        """This replica's id: `adapter_loaded` and `adapter_rejected` name it."""
        self.events = events
        self.table = table
        self.metrics = metrics
        self.last_loaded: dict[str, tuple[int, str]] = {}
        """Run -> (version, stream entry id) of the newest `adapter_loaded` this process appended
        for it (see `told_after`)."""

    def next_attempt(self, run: str, version: int) -> int:
        """The number of this load attempt of a version (0 first), counted in Redis.

        A restarted controller so never reuses a name that the still running engine saw from
        its predecessor.
        """
        return self.registry.next_load_attempt(run, version)

    def loaded(self, manifest: Manifest, name: str, load_ms: float, ready_to_loaded_ms: float | None,
               stages_ms: dict[str, float] | None = None, *, without: list[str] | None = None) -> None:
        """Record the run's serving version and append `adapter_loaded` for `manifest`'s version.

        `stages_ms`: the load's stages (the checks before the engine saw it, the checksums
        beside the engine's load), for anyone timing the sync path. `without`: the other ready
        replicas this one serves it without (they did not hold it within `replica.agree_s`)."""
        self.registry.set_serving(manifest.run, self.table.serving(manifest.run))
        data: dict[str, object] = {
            "adapter": name,
            "replica": self.replica,
            "load_ms": round(load_ms, 3),
            "ready_to_loaded_ms": None if ready_to_loaded_ms is None else round(ready_to_loaded_ms, 3),
            "step": manifest.step,
        }
        if ready_to_loaded_ms is not None:
            self.metrics.ready_to_serving_seconds.observe(ready_to_loaded_ms / 1000.0)
        if stages_ms:
            data["stages_ms"] = {k: round(v, 3) for k, v in stages_ms.items()}
        if without:
            data["without"] = sorted(without)
        entry_id = self.events.append(Event(
            kind=EventKind.ADAPTER_LOADED, run=manifest.run, version=manifest.version, job_id=manifest.job_id,
            data=data,
        ))
        last = self.last_loaded.get(manifest.run)
        if last is None or manifest.version >= last[0]:
            self.last_loaded[manifest.run] = (manifest.version, entry_id)

    def told_after(self, run: str, version: int, entry_id: str) -> bool:
        """Whether this process announced `run` serving `version` or a newer one in an entry after
        stream entry `entry_id` (an `adapter_ready`).

        A client waiting for its version reads on from its `adapter_ready` and takes any
        `adapter_loaded` of that version or a newer one, so such an announcement already told it;
        one that came before the `adapter_ready` (a version the periodic reconcile loaded before a
        retried trainer announced it) did not, and is made again."""
        last = self.last_loaded.get(run)
        return last is not None and last[0] >= version and entry_order(last[1]) > entry_order(entry_id)

    def forget(self, run: str) -> None:
        """A deleted run: what was announced of it matters no more."""
        self.last_loaded.pop(run, None)

    def held(self, run: str, version: int, job_id: str | None, held_at: float) -> None:
        """Append `adapter_held`: this replica loaded the version (at `held_at`, before its heartbeat
        said so) and waits for the others to hold it."""
        self.events.append(Event(kind=EventKind.ADAPTER_HELD, run=run, version=version, job_id=job_id,
                                 data={"replica": self.replica, "held_at": held_at}))

    def rejected(self, run: str, version: int | None, message: str, job_id: str | None) -> None:
        """Append `adapter_rejected` with the reason."""
        event = Event(kind=EventKind.ADAPTER_REJECTED, run=run, version=version, job_id=job_id,
                      data={"message": message, "replica": self.replica})
        self.events.append(event)

    def write_status(self, run: str) -> None:
        """Record the run's serving and loaded versions, in Redis and in the gauges."""
        self.registry.set_serving(run, self.table.serving(run))
        self.registry.set_loaded(run, self.table.loaded(run))
        self.show(run)

    def show(self, run: str) -> None:
        """Set the run's gauges from the table (no Redis write): every run the table knows has a
        series, version 0 before its first version loads."""
        self.metrics.serving.labels(run).set(self.table.serving(run))
        self.metrics.loaded.labels(run).set(len(self.table.loaded(run)))
