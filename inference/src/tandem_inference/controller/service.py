"""The inference controller: follows the event stream and hot-loads adapter versions.

On start it waits for the engine, then reconciles with the registry (reconciliation.py), so a
missed event can never leave a run serving a stale version. Then it follows `tandem:events`
from its persisted cursor (one per replica, `<controller.consumer>:<replica.id>`; a replica new
to the stream starts where the stream ended before that first reconcile), committing after each
event, so a restart neither misses nor repeats work; every `controller.reconcile_s` it
reconciles again. Events and reconciles take turns in one loop, so a reconcile can find a
version the trainer registered whose `adapter_ready` is not read yet: it leaves that version to
the event (read next), and an `adapter_ready` for a version this controller already announced
after it announces nothing again. Each version is so loaded once and announced once.

Only registered runs exist: an event for any other run is refused and makes no run. Each
`adapter_ready` is checked and loaded under a fresh name (adapter_loading.py); any refusal
appends `adapter_rejected` and the previous version keeps serving. A loaded version serves once
the other ready replicas hold it too (agreement.py). Versions that leave the
keep-window stop being routed at once and are unloaded when no request uses them
(unloading.py); a failed unload is retried later and never stops the controller. A deleted run
(`run_deleted`, or missing from the registry at a reconcile) stops resolving at once and its
adapters unload the same way.

The engine's slots (`engine.max_loaded_adapters`) may be fewer than the versions asked for: every
load first makes room, evicting the least recently used adapter no request holds (or, when every
one serves requests, draining the least recently used: out of routing, unloaded once its requests
end), and a request
for a registered version the engine does not hold has it loaded on demand
(tandem_inference.controller.slots).

The controller runs as a task of the inference service (tandem_inference.main), which starts
and stops it; any failure (the engine gone, Redis down, a bug) starts its cycle over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
from prometheus_client import CollectorRegistry

from tandem import keys
from tandem.adapters import AdapterStore
from tandem.errors import BackendUnavailable
from tandem.events import Cursor, Event, EventKind, EventStream
from tandem.registry import Registry
from tandem.replicas import Replicas, ReplicaState
from tandem.runs import RUN_NAME
from tandem.settings import InferenceSettings
from tandem_inference.controller.agreement import Agreement
from tandem_inference.controller.announcements import Announcer
from tandem_inference.controller.loading import AdapterLoader, Outcome
from tandem_inference.controller.metrics import ControllerMetrics
from tandem_inference.controller.reconciliation import Reconciler, quoted
from tandem_inference.controller.slots import SLOT_RETRY_AFTER_S, Slots
from tandem_inference.controller.unloading import Unloader
from tandem_inference.engines.base import Engine
from tandem_inference.errors import EngineUnreachable, ModelNotFound, Overloaded
from tandem_inference.routing import RoutingTable, VersionHold

log = logging.getLogger(__name__)

#: Pause between health checks while waiting for the engine, in seconds (doubles up to the max).
HEALTH_POLL_S = 0.25
HEALTH_POLL_MAX_S = 5.0
#: How often an idle controller checks the other replicas (is it behind?), in seconds.
ADVANCE_S = 1.0
#: Pause before the controller starts over after a failure, in seconds.
RESTART_PAUSE_S = 1.0


class Controller:
    """Keeps the engine's adapters and the routing table in step with the registry."""

    def __init__(
        self,
        settings: InferenceSettings,
        conn: redis.Redis,
        engine: Engine,
        store: AdapterStore,
        table: RoutingTable,
        *,
        metrics: CollectorRegistry | None = None,
        restart_engine: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.table = table
        self.registry = registry = Registry(conn)
        self.events = EventStream(conn)
        self.cursor = Cursor(conn, f"{settings.controller.consumer}:{settings.replica.id}")
        self.metrics = ControllerMetrics(metrics if metrics is not None else CollectorRegistry())
        self.unloader = Unloader(engine, table, self.metrics.unloads, restart_engine)
        """Retired versions and strays, unloaded by the follow loop (see tandem_inference.controller.unloading)."""
        self.announcer = Announcer(registry, self.events, table, self.metrics, replica=settings.replica.id)
        self.loader = AdapterLoader(settings, engine, store, table, registry, self.announcer, self.unloader,
                                    self.metrics)
        self.slots = self.loader.slots = Slots(engine, table, self.unloader,
                                               limit=settings.engine.max_loaded_adapters,
                                               wait_s=settings.controller.slot_wait_s,
                                               evictions=self.metrics.evictions,
                                               run_limit=settings.controller.run_max_loaded_adapters)
        """Room for each load: evicts the least recently used idle adapter (tandem_inference.controller.slots)."""
        self.slots.advance = self._advance  # every load runs under the lock, as _advance must
        self.reconciler = Reconciler(settings, engine, table, registry, self.loader, self.announcer, self.unloader,
                                     self.metrics)
        self.agreement = Agreement(Replicas(conn), settings.replica.id, table, settings.replica.agree_s,
                                   registered=lambda run, v: registry.manifest(run, v) is not None,
                                   ignored=self.metrics.ignored_claims)
        self.on_change: Callable[[], Awaitable[None]] | None = None
        """Called when what this replica holds, serves or whether it is in rotation changed (the
        service writes its heartbeat at once, so the other replicas see it)."""
        self.reconciled = False
        """True once the start-up reconciliation finished (the gateway's /ready needs it)."""
        self._next_reconcile = 0.0
        self._next_advance = 0.0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    # lifecycle --------------------------------------------------------------
    def start(self) -> asyncio.Task[None]:
        """Run the controller as a background task of the running loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="tandem-controller")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run(self) -> None:
        """Wait for the engine, reconcile, then follow the stream until cancelled.

        Any failure (the engine gone, Redis down, a bug) is logged and the cycle starts over,
        so the controller never stops while its process runs.
        """
        while True:
            try:
                await self.wait_for_engine()
                start = await asyncio.to_thread(self.events.last_id)  # what the reconcile covers
                await self.reconcile()
                await self.follow(start)
            except EngineUnreachable as exc:  # down, or healthy by /health yet answering 503
                self.engine_lost()
                log.warning("engine unavailable (%s); waiting %.0f s and for its health, then reconciling",
                            exc, RESTART_PAUSE_S)
                self.loader.forget_pending("the engine went away")
                await asyncio.sleep(RESTART_PAUSE_S)
            except BackendUnavailable as exc:
                log.warning("redis unavailable (%s); starting over in %.0f s", exc, RESTART_PAUSE_S)
                await asyncio.sleep(RESTART_PAUSE_S)
            except Exception:  # noqa: BLE001 - logged with its traceback; the loop must go on
                log.exception("controller failed; starting over in %.0f s", RESTART_PAUSE_S)
                await asyncio.sleep(RESTART_PAUSE_S)

    def engine_lost(self) -> None:
        """The engine went away (or is being restarted): what it held must be loaded again, so
        /ready says not ready until the next reconcile has done that."""
        self.reconciled = False

    async def wait_for_engine(self) -> float:
        """Block until the engine's /health answers 200; returns seconds waited."""
        t0 = time.monotonic()
        pause = HEALTH_POLL_S
        logged = False
        while not await self.engine.health():
            if not logged:
                log.info("waiting for the engine at %s", self.engine.url)
                logged = True
            await asyncio.sleep(pause)
            pause = min(HEALTH_POLL_MAX_S, pause * 2)
        waited = time.monotonic() - t0
        log.info("engine healthy at %s after %.1f s", self.engine.url, waited)
        return waited

    async def reconcile(self, *, adopt: bool = True, unread_after: str | None = None) -> None:
        """One reconciliation with the registry (see tandem_inference.controller.reconciliation); `adopt` at
        start-up and after an engine restart, not in the periodic one. `unread_after`: the follow
        loop's position in the stream; a new version whose `adapter_ready` is past it is not
        loaded here but by that event, read next (the fast path, announced at once)."""
        t0 = time.monotonic()
        async with self._lock:
            before = set(self.agreement.held)
            runs, lost = await self.reconciler.reconcile(adopt=adopt, hold=self.agreement.hold,
                                                         unread_after=unread_after)
            new = [self.agreement.held[key] for key in self.agreement.held.keys() - before]
            if new:  # loaded here, not from an event: tell the other replicas as an event load does
                if self.on_change is not None:
                    await self.on_change()
                for held in new:
                    await asyncio.to_thread(self.announcer.held, held.run, held.version, held.manifest.job_id,
                                            held.held_at)
            await self._advance()  # before it says it is ready: one that cannot load what the others serve is behind
        self.reconciled = True
        duration = time.monotonic() - t0
        self.metrics.reconcile_seconds.observe(duration)
        log.log(logging.INFO if adopt or lost else logging.DEBUG,
                "reconcile end runs=%d duration_ms=%.1f serving=%s", len(runs), duration * 1000,
                {r: self.table.serving(r) for r in runs})

    # the event stream -------------------------------------------------------
    async def follow(self, start: str = "0-0") -> None:
        """Handle events after the persisted cursor (`start` when there is none), forever; commit after each."""
        after = await asyncio.to_thread(self.cursor.get, start)
        block_ms = self.settings.controller.block_ms
        self._next_reconcile = time.monotonic() + self.settings.controller.reconcile_s
        log.info("following %s from %s", keys.EVENTS, after)
        while True:
            page = await asyncio.to_thread(self.events.read, after, block_ms=block_ms)
            newest = page.newest_ready()
            for event in page:
                await self.handle(event, newest)
                after = event.id or after
                await asyncio.to_thread(self.cursor.commit, after)
            if page.malformed:
                self.metrics.malformed_events.inc(len(page.malformed))
            if page.last_id != after:  # the page ended with malformed entries: read on past them
                after = page.last_id
                await asyncio.to_thread(self.cursor.commit, after)
            if self.agreement.held or len(page) or time.monotonic() >= self._next_advance:
                await self.advance()  # held versions, other replicas' news, else once a second
            await self.unload_retired()
            await self._tick(after)

    async def handle(self, event: Event, newest: dict[str, int] | None = None) -> None:
        """Act on one event: load an `adapter_ready`; note another replica's refusal; forget a
        deleted run (a `run_deleted` counts only for a run the registry no longer has). `newest`:
        each run's newest version announced in the page being handled (EventPage.newest_ready)."""
        if event.kind is EventKind.RUN_DELETED:
            if self.table.has_run(event.run) and not await asyncio.to_thread(self.registry.has_run, event.run):
                self.forget_run(event.run)
            return
        if event.kind is EventKind.ADAPTER_REJECTED and event.version is not None:
            replica = event.data.get("replica")
            if isinstance(replica, str):
                self.agreement.refused_by(event.run, event.version, replica)
            return
        if event.kind is not EventKind.ADAPTER_READY:
            return
        try:
            async with self._lock:
                await self._on_ready(event, (newest or {}).get(event.run, 0))
        except (EngineUnreachable, BackendUnavailable):
            raise  # not the event's fault: it is handled again after recovery
        except Overloaded as exc:  # every slot served a request: the periodic reconcile loads it later
            log.warning("%s v%s waits for the next reconcile: %s", event.run, event.version, exc)
        except Exception:  # noqa: BLE001 - one bad event must not stop the controller
            log.exception("handling event %s (%s %s v%s) failed; skipping it",
                          event.id, event.kind, quoted(event.run), event.version)

    async def _on_ready(self, event: Event, newest: int = 0) -> None:
        run, version = event.run, event.version
        if not RUN_NAME.fullmatch(run):
            self.metrics.rejections.labels("").inc()
            log.warning("adapter_rejected: event %s names run %s, which is no valid run name; skipping it",
                        event.id, quoted(run))
            return
        if not self.table.has_run(run):
            if run not in await self.reconciler.registered_runs():
                message = f"adapter_ready for run {run!r}, but no run {run!r} is registered; create the run first"
                await self.loader.reject(run, version, message, event.job_id, registered=False)
                return
            self.table.add_run(run)
        if version is None or version < 1:
            message = f"adapter_ready for {run!r} carries no valid version ({version})"
            await self.loader.reject(run, version, message, event.job_id)
            return
        name = self.table.adapter(run, version)
        serving = self.table.serving(run)
        if name is not None and version > serving:
            log.info("%s v%d is already held; it serves once the replicas agree", run, version)
            return
        if event.id is not None and self.announcer.told_after(run, version, event.id):
            # loaded before this event was read (by a reconcile that ran between the trainer's
            # registration and this read, or on demand), and announced after it: nothing to add
            log.info("%s v%d already serves and was announced after this adapter_ready", run, version)
            return
        if name is not None:  # e.g. loaded by the periodic reconcile before a retried trainer announced it
            log.info("%s v%d is already loaded as %s; announcing it again", run, version, name)
            manifest = await asyncio.to_thread(self.registry.manifest, run, version)
            if manifest is not None:
                await asyncio.to_thread(self.announcer.loaded, manifest, name, 0.0, None)
            return
        if serving > version:
            log.info("skipping %s v%d: v%d already serves", run, version, serving)
            return
        if serving == version:
            # it serves, but from no slot and unannounced: adopted at start-up from the engine of a
            # controller that died before announcing it, then evicted for room before this event was
            # read. Load it again and announce it, or the train() waiting for it would wait forever.
            log.info("%s v%d serves but was evicted before its adapter_ready was read; loading and announcing it",
                     run, version)
            await self.loader.load(run, version, ready_ts=event.ts, job_id=event.job_id, event_ts=event.ts)
            return
        if newest > version:  # a controller behind the trainer loads each run's newest, not every version
            log.info("skipping %s v%d: v%d of the run is announced after it, in this read", run, version, newest)
            return
        if self.loader.pending_for(run, version):
            log.info("skipping %s v%d: its timed-out load may still complete in the engine", run, version)
            return
        path = event.data.get("path")
        if path is not None and not isinstance(path, str):
            message = f"{run} v{version}: data.path {quoted(path)} is not a string"
            await self.loader.reject(run, version, message, event.job_id)
            return
        await self._load_new(run, version, path=path, ready_ts=event.ts, job_id=event.job_id, event_ts=event.ts)

    async def _load_new(self, run: str, version: int, *, path: str | None, ready_ts: float | None,
                        job_id: str | None, event_ts: float | None = None) -> Outcome:
        """Load a version newer than the run serves, held until the replicas agree (agreement.py)."""
        outcome = await self.loader.load(run, version, path=path, ready_ts=ready_ts, job_id=job_id,
                                         hold=self.agreement.hold, event_ts=event_ts)
        if outcome is Outcome.LOADED:
            others = await asyncio.to_thread(self.agreement.others)
            if others:  # replicas to agree with: tell them at once, then read what they hold afresh
                if self.on_change is not None:
                    await self.on_change()
                held = self.agreement.held.get((run, version))
                await asyncio.to_thread(self.announcer.held, run, version, job_id,
                                        held.held_at if held is not None else time.time())
            await self._advance(None if others else [])  # alone: the replicas just read stand, no second read
        return outcome

    # loading on demand ------------------------------------------------------
    async def checkout_on_demand(self, run: str, version: int, missing: ModelNotFound) -> VersionHold:
        """Load a registered version the engine does not hold (evicted for room, retired, or never
        loaded here) and hold it for one request; `missing` is the table's refusal, raised when the
        registry lacks the version or it cannot be loaded. Overloaded (429) while every engine
        slot serves a request for longer than `controller.slot_wait_s`, or when the engine did not
        load it in time. Loads are one at a time, so requests for one version share its load."""
        model = f"{run}@v{version}"
        async with self._lock:
            try:
                return self.table.checkout(model)  # loaded by a request that waited before this one
            except ModelNotFound:
                pass
            if not self.table.has_run(run):
                raise missing  # deleted meanwhile
            manifest = await asyncio.to_thread(self.registry.manifest, run, version)
            if manifest is None:
                raise no_such_version(run, version, await asyncio.to_thread(self.registry.versions, run)) from None
            if self.loader.rejected.get((run, version)) == manifest.created_at:
                raise ModelNotFound(f"{model} was refused when it was loaded (see its adapter_rejected event); "
                                    "it serves nowhere", known=missing.known)
            t0 = time.monotonic()
            if version > self.table.serving(run):  # its adapter_ready has not been handled yet
                outcome = await self._load_new(run, version, path=None, ready_ts=manifest.created_at,
                                               job_id=manifest.job_id)
            else:
                outcome = await self.loader.load(run, version, job_id=manifest.job_id, announce=False)
            if outcome is Outcome.PENDING:
                raise Overloaded(f"the engine did not load {model} within {self.settings.engine.load_timeout_s:g} s "
                                 f"(engine.load_timeout_s); retry after {SLOT_RETRY_AFTER_S} s",
                                 reason="adapter_load", retry_after_s=SLOT_RETRY_AFTER_S)
            if outcome is Outcome.GONE:
                raise missing  # deleted while it loaded
            if outcome is Outcome.REFUSED:
                raise ModelNotFound(f"{model} could not be loaded (see its adapter_rejected event); it serves "
                                    "nowhere", known=missing.known)
            self.metrics.on_demand_loads.labels(run).inc()
            await asyncio.to_thread(self.announcer.write_status, run)
            log.info("adapter_on_demand end run=%s version=%d duration_ms=%.1f", run, version,
                     (time.monotonic() - t0) * 1000)
            return self.table.checkout(model)

    async def advance(self) -> None:
        """Serve the held versions the replicas agree on; recheck whether this replica is behind."""
        async with self._lock:
            await self._advance()
        self._next_advance = time.monotonic() + ADVANCE_S

    async def _advance(self, others: list[ReplicaState] | None = None) -> None:
        """Serve what is due; `others`: the other ready replicas, read just now (None: read them)."""
        if others is None:
            others = await asyncio.to_thread(self.agreement.others)
        due = self.agreement.due(others)
        for held in due:
            self.table.serve(held.run, held.version)
            # in the same step as the switch: no request sees the new version serve beside one past the window
            self.unloader.retire_old(held.run, self.settings.controller.keep_versions)  # unloaded outside the lock
            stages = {**held.stages_ms, "agree": (time.monotonic() - held.since) * 1000}
            await asyncio.to_thread(self.announcer.loaded, held.manifest, held.adapter, held.load_ms,
                                    held.ready_to_loaded_ms(), stages, without=held.without)
            await asyncio.to_thread(self.announcer.write_status, held.run)
        changed = await asyncio.to_thread(self.agreement.check_behind, others)
        if (due or changed) and self.on_change is not None:
            await self.on_change()

    async def _tick(self, after: str) -> None:
        """The periodic reconcile, every `controller.reconcile_s`; `after` is the last stream entry
        handled: a version whose `adapter_ready` is past it is left to that event."""
        now = time.monotonic()
        if now < self._next_reconcile:
            return
        await self.reconcile(adopt=False, unread_after=after)
        self._next_reconcile = time.monotonic() + self.settings.controller.reconcile_s

    # unloading and status ---------------------------------------------------
    def forget_run(self, run: str) -> None:
        """A deleted run: it resolves no more, and its adapters unload once no request holds them
        (tandem_inference.controller.reconciliation). No Redis write: the run's keys are gone."""
        self.reconciler.forget(run)

    async def unload_retired(self) -> None:
        """Unload retired versions that no request uses, and strays; failures are retried later."""
        for run in await self.unloader.unload_idle():
            if self.table.has_run(run):  # a deleted run's status is not written back
                await asyncio.to_thread(self.announcer.write_status, run)

    def status(self) -> dict[str, Any]:
        return {
            "reconciled": self.reconciled,
            "in_rotation": self.agreement.in_rotation,
            "behind": self.agreement.behind,
            "held": sorted(f"{run}@v{version}" for run, version in self.agreement.held),
            "retiring": sorted(self.unloader.queued),
            "pending_loads": sorted(self.loader.pending),
            "runs": self.table.snapshot(),
        }


KNOWN_VERSIONS_SHOWN = 20
"""The newest registered versions a 404 for a missing version lists (its `known`)."""


def no_such_version(run: str, version: int, registered: list[int]) -> ModelNotFound:
    """A pinned version the registry lacks: the 404 names the versions that do load on request,
    not only those loaded now."""
    shown = [f"{run}@v{v}" for v in registered[-KNOWN_VERSIONS_SHOWN:]]
    if not registered:
        have = "it has no versions yet (only the base model, v0)"
    elif len(registered) > KNOWN_VERSIONS_SHOWN:
        have = f"it has {len(registered)} versions, v{registered[0]} to v{registered[-1]}"
    else:
        have = f"its versions are {', '.join(f'v{v}' for v in registered)}"
    return ModelNotFound(
        f"run {run!r} has no version {version}: {have} (retention may have removed older ones); ask for "
        f"{run!r} (its newest) or one of those", known=[f"{run}@v0", *shown])
