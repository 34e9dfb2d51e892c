"""Reconciliation: the engine and the routing table brought in step with the registry.

At start-up and every `controller.reconcile_s`, whatever events were missed: every registered
run's newest registered version is loaded if it does not serve (a version registered but never
announced, e.g. by a trainer killed in between), versions the engine lost (it restarted) are
loaded again under new names, and adapters the engine holds are sorted: routed ones are left
alone, at start-up the ones of registered versions are adopted if their files check out, and
the rest (strays, e.g. a load that completed after its timeout) are unloaded.

The periodic reconcile leaves a new version to its `adapter_ready` when that event is already in
the stream but not read yet (UnreadReady): each version is loaded once, on the event's path, and
announced once, whichever of the two comes first.

Only registered runs exist: names in the registry that are no valid run name (a foreign write)
are skipped, and adapters tandem did not name are left alone. A run the registry no longer has
(deleted: tandem.deletion) is forgotten: it stops resolving at once, and its adapters, like those
of any run that is not registered, are unloaded once no request holds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from tandem.errors import BackendUnavailable
from tandem.events import EventKind, EventStream
from tandem.registry import Registry
from tandem.runs import RUN_NAME, parse_adapter_name
from tandem.settings import InferenceSettings
from tandem_inference.controller.agreement import Held
from tandem_inference.controller.announcements import Announcer
from tandem_inference.controller.loading import AdapterLoader, Outcome
from tandem_inference.controller.metrics import ControllerMetrics
from tandem_inference.controller.unloading import Unloader
from tandem_inference.engines.base import Engine
from tandem_inference.errors import EngineUnreachable, Overloaded
from tandem_inference.routing import RoutingTable

log = logging.getLogger(__name__)

#: Most stream entries a periodic reconcile reads past the controller's cursor to find the
#: `adapter_ready` events not handled yet (a controller further behind loads from the reconcile).
UNREAD_SCAN_LIMIT = 10_000
#: Longest text of an untrusted value (an event field, a registry entry) quoted in a log line.
QUOTE_CHARS = 120


def quoted(value: object) -> str:
    """repr of an untrusted value, cut short: stream entries and registry names may be huge."""
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}... ({len(text)} chars)"


class UnreadReady:
    """The `adapter_ready` events the follow loop has not read yet, read from the stream only when
    a version is about to be loaded (each look reads on from where the last one ended, so an event
    appended while the reconcile runs is seen too).

    The trainer registers a version, then appends its `adapter_ready`; the controller reads
    events and reconciles in turn, so a reconcile that runs while the trainer publishes finds the
    version registered with its event waiting in the stream. Loading it there would put the
    version on the slow path (announced only when the whole reconcile is done) and leave its
    event to announce it a second time; it is left to the event, read right after. A version
    with no event past the cursor (a trainer killed between the two writes, an event lost or
    trimmed) is loaded by the reconcile as before: the safety net stays.
    """

    def __init__(self, events: EventStream, after: str) -> None:
        self.events = events
        self.after = after
        """The last entry read: the follow loop's position, then the end of the last look."""
        self.left = UNREAD_SCAN_LIMIT
        """Entries this reconcile may still read."""
        self.ready: set[tuple[str, int]] = set()

    async def holds(self, run: str, version: int) -> bool:
        """Whether an unread `adapter_ready` names this version."""
        if (run, version) not in self.ready and self.left > 0:
            page = await asyncio.to_thread(self.events.unread, self.after, limit=self.left)
            self.left -= len(page) + len(page.malformed)
            self.after = page.last_id
            self.ready.update((e.run, e.version) for e in page
                              if e.kind is EventKind.ADAPTER_READY and e.version is not None)
        return (run, version) in self.ready


class Reconciler:
    """One reconciliation of the engine and the routing table with the registry."""

    def __init__(self, settings: InferenceSettings, engine: Engine, table: RoutingTable, registry: Registry,
                 loader: AdapterLoader, announcer: Announcer, unloader: Unloader, metrics: ControllerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.table = table
        self.registry = registry
        self.loader = loader
        self.announcer = announcer
        self.unloader = unloader
        self.metrics = metrics

    async def reconcile(self, *, adopt: bool, hold: Callable[[Held], None] | None = None,
                        unread_after: str | None = None) -> tuple[list[str], bool]:
        """Make the engine and the table serve every registered run's newest registered version.

        Versions the table routes to but the engine lost are loaded again. With `adopt` (at
        start-up), adapters the engine still holds from before a controller restart are routed
        to if their files check out; without it (the periodic reconcile), an adapter the engine
        holds that nothing routes to is a stray and is unloaded, unless it is a timed-out load
        of a version still wanted (then it serves). Returns the registered runs, and whether
        the engine had lost adapters. With `hold`, a newest version loaded here is handed over held,
        to serve once the replicas agree (tandem_inference.controller.agreement), like one loaded from an event.
        With `unread_after` (the periodic reconcile: the last stream entry the controller handled),
        a newest version whose `adapter_ready` is already in the stream past it is left to that
        event (see `UnreadReady`).
        """
        held = await self.unloader.ledger.look(self.engine)
        runs = await self.registered_runs()
        for run in set(self.table.runs()) - set(runs):
            self.forget(run)
        for run in runs:
            self.table.add_run(run)
        before = {run: (self.table.serving(run), self.table.loaded(run)) for run in runs}
        lost = [(run, v) for run in self.table.runs() for v in self.table.loaded(run)
                if self.table.adapter(run, v) not in held]
        if lost:
            log.warning("engine lost adapters %s (restarted?); loading them again",
                        [self.table.adapter(run, v) for run, v in lost])
            self.loader.forget_engine()
        for run, version in lost:
            try:
                outcome = await self.loader.load(run, version, announce=False)
            except Overloaded:  # every slot serves a request: loaded on demand when asked
                outcome = Outcome.REFUSED
            if outcome is not Outcome.LOADED and outcome is not Outcome.GONE:
                self.table.retire(run, version)
        for name, path in held.items():
            await self._sort_held(name, path, runs, adopt=adopt)
        self.loader.forget_old_pending()
        unread = UnreadReady(self.announcer.events, unread_after) if unread_after is not None else None
        for run in runs:
            try:
                await self._load_newest(run, hold, unread)
            except (EngineUnreachable, BackendUnavailable):
                raise
            except Overloaded as exc:
                log.warning("reconciling run %s: %s; the next reconcile tries again", run, exc)
            except Exception:  # noqa: BLE001 - one run's bad registry entry must not stop the others
                log.exception("reconciling run %s failed; the next reconcile tries again", run)
            self.unloader.retire_old(run, self.settings.controller.keep_versions)
            if adopt or before[run] != (self.table.serving(run), self.table.loaded(run)):
                await asyncio.to_thread(self.announcer.write_status, run)
            else:
                self.announcer.show(run)  # a run created since, with no version yet, gets its series
        return runs, bool(lost)

    async def registered_runs(self) -> list[str]:
        """Runs in the registry; a name that is no valid run name (a foreign write) is skipped."""
        runs = []
        for run in await asyncio.to_thread(self.registry.list_runs):
            if RUN_NAME.fullmatch(run):
                runs.append(run)
            else:
                log.warning("the registry lists run %s, which is no valid run name; ignoring it", quoted(run))
        return runs

    def forget(self, run: str) -> None:
        """Stop routing to a run the registry no longer has (deleted), and queue its adapters for
        unloading once the requests that hold them end; its gauges go too."""
        dropped = self.table.drop_run(run)
        self.announcer.forget(run)
        for version, name in dropped.items():
            self.unloader.add(name, run, version, routed=True)
        for gauge in (self.metrics.serving, self.metrics.loaded):
            with contextlib.suppress(KeyError):  # a run the table knew without a series yet
                gauge.remove(run)
        log.info("run.forgotten run=%s unloading=%s: the run is deleted", run, sorted(dropped.values()))

    async def _load_newest(self, run: str, hold: Callable[[Held], None] | None = None,
                           unread: UnreadReady | None = None) -> None:
        """Load the run's newest registered version if it does not serve.

        A version refused before (same manifest) or whose timed-out load may still complete
        is not tried again; refused ones fall back to the next older one. A version the store
        did not show (it may lag) is tried again once its backoff has passed. A version whose
        `adapter_ready` is in `unread` is left to that event.
        """
        serving = self.table.serving(run)
        if await asyncio.to_thread(self.registry.latest_version, run) <= serving:
            return
        manifests = await asyncio.to_thread(self.registry.manifests, run)
        for manifest in reversed(manifests):
            if manifest.version <= serving or self.loader.pending_for(run, manifest.version):
                break
            if self.table.adapter(run, manifest.version) is not None:
                break  # held: it serves once the replicas agree (tandem_inference.controller.agreement)
            if self.loader.rejected.get((run, manifest.version)) == manifest.created_at:
                continue
            if not self.loader.retry_due(run, manifest.version):
                break  # not shown by the store a moment ago: tried again after its backoff
            if unread is not None and await unread.holds(run, manifest.version):
                log.info("%s v%d is registered and its adapter_ready is in the stream, not handled yet; it loads "
                         "from that event", run, manifest.version)
                break
            outcome = await self.loader.load(run, manifest.version, ready_ts=manifest.created_at,
                                             job_id=manifest.job_id, hold=hold)
            if outcome is not Outcome.REFUSED:
                break

    async def _sort_held(self, name: str, path: str, runs: list[str], *, adopt: bool) -> None:
        """Decide about one adapter the engine holds: routed, being unloaded, a late load, to
        adopt, a stray, or one of a run that is not registered (deleted). Adapters tandem did not
        name are left alone."""
        parsed = parse_adapter_name(name)
        if parsed is None or name in self.unloader:
            return
        run, version, _ = parsed
        if run not in runs:
            log.warning("engine holds %s, of run %s, which is not registered (deleted); unloading it", name, run)
            self.metrics.strays.labels(run).inc()
            self.unloader.add(name, run, version, routed=True)  # requests may hold it still
            return
        if self.table.adapter(run, version) == name:
            return
        late = self.loader.pending.pop(name, None)
        wanted = version > self.table.serving(run) and (run, version) not in self.loader.rejected
        if (late is not None and wanted) or (adopt and version not in self.table.loaded(run)):
            await self.loader.adopt(name, path, run, version, announce=late is not None)
            return
        log.warning("engine holds %s, which nothing routes to%s; unloading it", name,
                    " (a load that completed after its timeout)" if late is not None else "")
        self.metrics.strays.labels(run).inc()
        self.unloader.add(name, run, version, routed=False)
