"""The inference controller: follows the event stream and hot-loads adapter versions.

On start it waits for the engine, then reconciles with the registry (every run's newest
registered version is verified and loaded), so a missed event can never leave a run serving
a stale version. Then it follows `tandem:events` from its persisted cursor, committing after
each event, so a restart neither misses nor repeats work. Every `controller.reconcile_s` it
reconciles again: a version registered but never announced (a trainer killed in between) is
loaded, versions the engine lost are loaded again, and adapters the engine holds that nothing
routes to (strays, e.g. a load that completed after its timeout) are unloaded.

Only registered runs exist: an event for any other run is refused and makes no run. For each
`adapter_ready` the store's `check` runs before the engine sees the version (the event's path
is the version's adapter directory, no symlink anywhere, exactly the manifest's files), then
the rank is checked against the engine's. The engine loads it under a name it was never given
(`<run>-v<N>`, then `-a1`, `-a2`, ... for later attempts) while the checksums are checked; only
when both succeeded does the run's alias move (routing table, then registry), and
`adapter_loaded` is appended. Any refusal appends `adapter_rejected` and the previous version
keeps serving. Versions that leave the keep-window stop being routed at once and are unloaded
when no request uses them; a failed unload is retried later and never stops the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem import keys
from tandem.adapters import ADAPTER_DIR, AdapterStore, Manifest
from tandem.errors import AdapterRejected, BackendUnavailable
from tandem.events import Cursor, Event, EventKind, EventStream
from tandem.registry import Registry
from tandem.runs import RUN_NAME, adapter_name, parse_adapter_name
from tandem.settings import InferenceSettings
from tandem_inference.engine_client import CallKind, EngineClient
from tandem_inference.errors import (
    AdapterLoadError,
    EngineError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
)
from tandem_inference.routing import RoutingTable
from tandem_inference.unloading import Unloader

log = logging.getLogger("tandem.controller")

#: Pause between health checks while waiting for the engine, in seconds (doubles up to the max).
HEALTH_POLL_S = 0.25
HEALTH_POLL_MAX_S = 5.0
#: Pause before the controller starts over after a failure, in seconds.
RESTART_PAUSE_S = 1.0
#: A load that timed out is left to complete in the engine for this many load timeouts before
#: the version is tried again under a new name (a busy engine finishes it; trying sooner would
#: only queue more loads behind it).
PENDING_LOAD_TIMEOUTS = 10
#: A timed-out load the engine never lists is forgotten after this long, in seconds (should it
#: still appear, it is a stray like any other).
PENDING_FORGET_S = 3600.0
#: Longest text of an event field quoted in a log line or message.
QUOTE_CHARS = 120


def _quote(value: object) -> str:
    """repr of a value from an event, cut short: entries are untrusted and may be huge."""
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}... ({len(text)} chars)"


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
        self.serving = Gauge("tandem_serving_version", "Version each run is routed to (0 = base).", ["run"],
                             registry=registry)
        self.loaded = Gauge("tandem_loaded_versions", "Versions the engine holds per run.", ["run"],
                            registry=registry)
        self.malformed_events = Counter(
            "tandem_controller_malformed_events", "Stream entries skipped because they do not parse.",
            registry=registry,
        )
        self.reconcile_seconds = Histogram(
            "tandem_controller_reconcile_seconds", "Time one reconciliation with the registry and engine took.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry,
        )


class _Outcome(Enum):
    LOADED = "loaded"
    REFUSED = "refused"
    """Rejected (an `adapter_rejected` was appended); an older version may be tried."""
    PENDING = "pending"
    """The engine did not answer in time; the load may still complete there."""


@dataclass
class _Pending:
    """A load that timed out; the engine may still complete it."""

    run: str
    version: int
    since: float
    retry_after: float


class Controller:
    """Keeps the engine's adapters and the routing table in step with the registry."""

    def __init__(
        self,
        settings: InferenceSettings,
        conn: redis.Redis,
        engine: EngineClient,
        store: AdapterStore,
        table: RoutingTable,
        *,
        metrics: CollectorRegistry | None = None,
        restart_engine: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.conn = conn
        self.engine = engine
        self.store = store
        self.table = table
        self.registry = Registry(conn)
        self.events = EventStream(conn)
        self.cursor = Cursor(conn, settings.controller.consumer)
        self.metrics = ControllerMetrics(metrics if metrics is not None else CollectorRegistry())
        self.unloader = Unloader(engine, table, self.metrics.unloads, restart_engine)
        """Retired versions and strays, unloaded by the follow loop (see tandem_inference.unloading)."""
        self.reconciled = False
        """True once the start-up reconciliation finished (the gateway's /ready needs it)."""
        self._pending: dict[str, _Pending] = {}
        """Adapter name -> a load of it that timed out."""
        self._rejected: dict[tuple[str, int], float] = {}
        """(run, version) -> `created_at` of the registered manifest that was refused; the
        periodic reconcile does not try it again until the version is registered anew."""
        self._max_rank: int | None = None
        self._next_reconcile = 0.0
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
                await self.reconcile()
                await self.follow()
            except EngineUnavailable as exc:  # down, or healthy by /health yet answering 503
                log.warning("engine unavailable (%s); waiting %.0f s and for its health, then reconciling",
                            exc, RESTART_PAUSE_S)
                self._forget_pending("the engine went away")
                await asyncio.sleep(RESTART_PAUSE_S)
            except (redis.RedisError, BackendUnavailable) as exc:
                log.warning("redis unavailable (%s); starting over in %.0f s", exc, RESTART_PAUSE_S)
                await asyncio.sleep(RESTART_PAUSE_S)
            except Exception:  # noqa: BLE001 - logged with its traceback; the loop must go on
                log.exception("controller failed; starting over in %.0f s", RESTART_PAUSE_S)
                await asyncio.sleep(RESTART_PAUSE_S)

    async def wait_for_engine(self) -> float:
        """Block until the engine's /health answers 200; returns seconds waited."""
        t0 = time.monotonic()
        pause = HEALTH_POLL_S
        logged = False
        while not await self.engine.health():
            if not logged:
                log.info("waiting for the engine at %s", self.engine.base_url)
                logged = True
            await asyncio.sleep(pause)
            pause = min(HEALTH_POLL_MAX_S, pause * 2)
        waited = time.monotonic() - t0
        log.info("engine healthy at %s after %.1f s", self.engine.base_url, waited)
        return waited

    # reconciliation ---------------------------------------------------------
    async def reconcile(self, *, adopt: bool = True) -> None:
        """Make the engine and the table serve every registered run's newest registered version.

        Versions the table routes to but the engine lost (it restarted) are loaded again,
        under new names. With `adopt` (at start-up), adapters the engine still holds from
        before a controller restart are routed to if their files check out; without it (the
        periodic reconcile), an adapter the engine holds that nothing routes to is a stray and
        is unloaded, unless it is a timed-out load of a version still wanted (then it serves).
        Then the newest registered version of each run is loaded if it is not.
        """
        t0 = time.monotonic()
        async with self._lock:
            held = await self.engine.loaded_adapters()
            runs = await self._registered_runs()
            for run in runs:
                self.table.add_run(run)
            before = {run: (self.table.serving(run), self.table.loaded(run)) for run in runs}
            lost = [(run, v) for run in self.table.runs() for v in self.table.loaded(run)
                    if self.table.adapter(run, v) not in held]
            if lost:
                log.warning("engine lost adapters %s (restarted?); loading them again",
                            [self.table.adapter(run, v) for run, v in lost])
                self._max_rank = None
                self._forget_pending("the engine restarted")
            for run, version in lost:
                if await self._load(run, version, announce=False) is not _Outcome.LOADED:
                    self.table.retire(run, version)
            for name, path in held.items():
                await self._sort_held(name, path, runs, adopt=adopt)
            self._forget_old_pending()
            for run in runs:
                try:
                    await self._load_newest(run)
                except (EngineUnavailable, redis.RedisError, BackendUnavailable):
                    raise
                except Exception:  # noqa: BLE001 - one run's bad registry entry must not stop the others
                    log.exception("reconciling run %s failed; the next reconcile tries again", run)
                self._retire_old(run)
                if adopt or before[run] != (self.table.serving(run), self.table.loaded(run)):
                    await asyncio.to_thread(self._write_status, run)
        self.reconciled = True
        duration = time.monotonic() - t0
        self.metrics.reconcile_seconds.observe(duration)
        log.log(logging.INFO if adopt or lost else logging.DEBUG,
                "reconcile end runs=%d duration_ms=%.1f serving=%s", len(runs), duration * 1000,
                {r: self.table.serving(r) for r in runs})

    async def _registered_runs(self) -> list[str]:
        """Runs in the registry; a name that is no valid run name (a foreign write) is skipped."""
        runs = []
        for run in await asyncio.to_thread(self.registry.list_runs):
            if RUN_NAME.match(run):
                runs.append(run)
            else:
                log.warning("the registry lists run %s, which is no valid run name; ignoring it", _quote(run))
        return runs

    async def _load_newest(self, run: str) -> None:
        """Load the run's newest registered version if it does not serve.

        A version refused before (same manifest) or whose timed-out load may still complete
        is not tried again; refused ones fall back to the next older one.
        """
        serving = self.table.serving(run)
        if await asyncio.to_thread(self.registry.latest_version, run) <= serving:
            return
        manifests = await asyncio.to_thread(self.registry.manifests, run)
        for manifest in reversed(manifests):
            if manifest.version <= serving or self._pending_for(run, manifest.version):
                break
            if self._rejected.get((run, manifest.version)) == manifest.created_at:
                continue
            outcome = await self._load(run, manifest.version, ready_ts=manifest.created_at, job_id=manifest.job_id)
            if outcome is not _Outcome.REFUSED:
                break

    async def _sort_held(self, name: str, path: str, runs: list[str], *, adopt: bool) -> None:
        """Decide about one adapter the engine holds: routed, being unloaded, a late load, to
        adopt, or a stray. Adapters tandem did not name, or of runs not registered, are left alone."""
        parsed = parse_adapter_name(name)
        if parsed is None or parsed[0] not in runs:
            return
        run, version, _ = parsed
        if self.table.adapter(run, version) == name or name in self.unloader:
            return
        late = self._pending.pop(name, None)
        wanted = version > self.table.serving(run) and (run, version) not in self._rejected
        if (late is not None and wanted) or (adopt and version not in self.table.loaded(run)):
            await self._adopt(name, path, run, version, announce=late is not None)
            return
        log.warning("engine holds %s, which nothing routes to%s; unloading it", name,
                    " (a load that completed after its timeout)" if late is not None else "")
        self.metrics.strays.labels(run).inc()
        self.unloader.add(name, run, version, routed=False)

    async def _adopt(self, name: str, path: str, run: str, version: int, *, announce: bool) -> None:
        """Route to an adapter the engine already holds if it was loaded from this version's
        directory and its files check out; one that fails its checks is rejected and unloaded.

        `announce`: append `adapter_loaded` (a timed-out load that completed after all)."""
        expected = self.store.adapter_dir(run, version)
        if path and Path(path).resolve() != expected:
            log.warning("engine holds %s from %s, not %s; unloading it", name, path, expected)
            self.unloader.add(name, run, version, routed=False)
            return
        try:
            manifest = await asyncio.to_thread(self._verify, run, version)
        except AdapterRejected as exc:
            log.warning("engine holds %s, but %s; unloading it", name, exc)
            self.unloader.add(name, run, version, routed=False)
            await self._reject(run, version, str(exc), None)
            return
        log.info("adopting %s, already loaded in the engine", name)
        self.table.add_version(run, version, name)
        self._rejected.pop((run, version), None)
        if announce:
            self.metrics.loads.labels(run).inc()
            await asyncio.to_thread(self._announce, manifest, name, 0.0, None)

    def _pending_for(self, run: str, version: int) -> bool:
        """Whether a timed-out load of this version may still complete (so no new one is sent)."""
        now = time.monotonic()
        return any(p.run == run and p.version == version and p.retry_after > now for p in self._pending.values())

    def _forget_pending(self, why: str) -> None:
        """No timed-out load can complete in an engine that restarted: load those versions anew."""
        if self._pending:
            log.info("forgetting timed-out loads %s: %s", sorted(self._pending), why)
            self._pending.clear()

    def _forget_old_pending(self) -> None:
        now = time.monotonic()
        for name, pending in list(self._pending.items()):
            if now - pending.since > PENDING_FORGET_S:
                log.info("forgetting the timed-out load of %s; the engine never listed it", name)
                del self._pending[name]

    async def _tick(self) -> None:
        """The periodic reconcile, every `controller.reconcile_s`."""
        now = time.monotonic()
        if now < self._next_reconcile:
            return
        await self.reconcile(adopt=False)
        self._next_reconcile = time.monotonic() + self.settings.controller.reconcile_s

    # the event stream -------------------------------------------------------
    async def follow(self) -> None:
        """Handle events after the persisted cursor, forever; commit after each."""
        after = await asyncio.to_thread(self.cursor.get)
        block_ms = self.settings.controller.block_ms
        self._next_reconcile = time.monotonic() + self.settings.controller.reconcile_s
        log.info("following %s from %s", keys.EVENTS, after)
        while True:
            page = await asyncio.to_thread(self.events.read, after, block_ms=block_ms)
            for event in page:
                await self.handle(event)
                after = event.id or after
                await asyncio.to_thread(self.cursor.commit, after)
            if page.malformed:
                self.metrics.malformed_events.inc(len(page.malformed))
            if page.last_id != after:  # the page ended with malformed entries: read on past them
                after = page.last_id
                await asyncio.to_thread(self.cursor.commit, after)
            await self.unload_retired()
            await self._tick()

    async def handle(self, event: Event) -> None:
        """Act on one event; only `adapter_ready` needs anything."""
        if event.kind is not EventKind.ADAPTER_READY:
            return
        try:
            async with self._lock:
                await self._on_ready(event)
        except (EngineUnavailable, redis.RedisError, BackendUnavailable):
            raise  # not the event's fault: it is handled again after recovery
        except Exception:  # noqa: BLE001 - one bad event must not stop the controller
            log.exception("handling event %s (%s %s v%s) failed; skipping it",
                          event.id, event.kind, _quote(event.run), event.version)

    async def _on_ready(self, event: Event) -> None:
        run, version = event.run, event.version
        if not RUN_NAME.match(run):
            self.metrics.rejections.labels("").inc()
            log.warning("adapter_rejected: event %s names run %s, which is no valid run name; skipping it",
                        event.id, _quote(run))
            return
        if not self.table.has_run(run):
            if run not in await self._registered_runs():
                message = f"adapter_ready for run {run!r}, but no run {run!r} is registered; create the run first"
                await self._reject(run, version, message, event.job_id, registered=False)
                return
            self.table.add_run(run)
        if version is None or version < 1:
            message = f"adapter_ready for {run!r} carries no valid version ({version})"
            await self._reject(run, version, message, event.job_id)
            return
        name = self.table.adapter(run, version)
        if name is not None:  # e.g. loaded by the periodic reconcile before a retried trainer announced it
            log.info("%s v%d is already loaded as %s; announcing it again", run, version, name)
            manifest = await asyncio.to_thread(self.registry.manifest, run, version)
            if manifest is not None:
                await asyncio.to_thread(self._announce, manifest, name, 0.0, None)
            return
        serving = self.table.serving(run)
        if serving > version:
            log.info("skipping %s v%d: v%d already serves", run, version, serving)
            return
        if self._pending_for(run, version):
            log.info("skipping %s v%d: its timed-out load may still complete in the engine", run, version)
            return
        path = event.data.get("path")
        if path is not None and not isinstance(path, str):
            message = f"{run} v{version}: data.path {_quote(path)} is not a string"
            await self._reject(run, version, message, event.job_id)
            return
        if await self._load(run, version, path=path, ready_ts=event.ts, job_id=event.job_id) is _Outcome.LOADED:
            self._retire_old(run)  # unloaded by the follow loop, outside the lock
            await asyncio.to_thread(self._write_status, run)

    # loading ----------------------------------------------------------------
    async def _load(
        self, run: str, version: int, *, path: str | None = None, ready_ts: float | None = None,
        job_id: str | None = None, announce: bool = True,
    ) -> _Outcome:
        """Check and load one version under a fresh name, then switch the alias.

        REFUSED (and an `adapter_rejected`) if the version fails a check or the engine refuses
        it; PENDING if the engine did not answer in time (a later reconcile routes the late
        completion or unloads it).
        """
        t0 = time.monotonic()
        try:
            max_rank = await self._max_lora_rank()
            adapter_dir = await asyncio.to_thread(self._check, run, version, path, max_rank)
        except AdapterRejected as exc:
            await self._reject(run, version, str(exc), job_id)
            return _Outcome.REFUSED
        name = await asyncio.to_thread(self._fresh_name, run, version)
        log.info("adapter_load start run=%s version=%d adapter=%s", run, version, name)
        # the checksums run while the engine loads; the alias switches only when both succeeded
        checksums = asyncio.create_task(asyncio.to_thread(self._verify, run, version))
        refused: AdapterLoadError | None = None
        try:
            load_ms = await self.engine.load_adapter(name, str(adapter_dir))
        except AdapterLoadError as exc:
            load_ms, refused = 0.0, exc
        except EngineTimeout as exc:
            now = time.monotonic()
            retry_s = PENDING_LOAD_TIMEOUTS * self.engine.timeouts_s[CallKind.LOAD]
            self._pending[name] = _Pending(run, version, since=now, retry_after=now + retry_s)
            self.metrics.load_timeouts.labels(run).inc()
            log.warning("adapter_load timeout run=%s version=%d adapter=%s (%s); if the engine completes it, "
                        "it serves when still the newest, else it is unloaded; no new attempt for %.0f s",
                        run, version, name, exc, retry_s)
            return _Outcome.PENDING
        finally:
            (checked,) = await asyncio.gather(checksums, return_exceptions=True)  # never left running
        held = refused is None or await self._engine_holds(name, adapter_dir)
        if isinstance(checked, BaseException):
            if held:
                await self._unload_quietly(run, version, name)
            message = str(checked) if isinstance(checked, AdapterRejected) else repr(checked)
            await self._reject(run, version, message, job_id)  # before the engine's refusal: it names the files
            return _Outcome.REFUSED
        if refused is not None and not held:
            await self._reject(run, version, str(refused), job_id)
            return _Outcome.REFUSED
        manifest = checked
        self.table.add_version(run, version, name)
        self._rejected.pop((run, version), None)
        self.metrics.loads.labels(run).inc()
        self.metrics.load_seconds.observe(load_ms / 1000.0)
        ready_to_loaded_ms = (time.time() - ready_ts) * 1000.0 if ready_ts is not None else None
        if announce:
            await asyncio.to_thread(self._announce, manifest, name, load_ms, ready_to_loaded_ms)
        log.info("adapter_load end run=%s version=%d adapter=%s load_ms=%.1f ready_to_loaded_ms=%s "
                 "duration_ms=%.1f",
                 run, version, name, load_ms,
                 f"{ready_to_loaded_ms:.1f}" if ready_to_loaded_ms is not None else "-",
                 (time.monotonic() - t0) * 1000)
        return _Outcome.LOADED

    def _fresh_name(self, run: str, version: int) -> str:
        """A name for the next load attempt of a version that the engine was never given.

        The attempt count lives in Redis, so a restarted controller never reuses a name that
        the still running engine saw from its predecessor.
        """
        try:
            attempts = int(self.conn.hincrby(keys.run_load_attempts(run), str(version), 1))
        except redis.RedisError as exc:
            raise BackendUnavailable(f"cannot count the load attempts of {run} v{version}: {exc}") from exc
        return adapter_name(run, version, attempts - 1)

    def _verify(self, run: str, version: int) -> Manifest:
        """The checksums of what the engine loads; any failure to check them is a rejection."""
        try:
            return self.store.verify(run, version, only=ADAPTER_DIR)
        except AdapterRejected:
            raise
        except Exception as exc:  # noqa: BLE001 - unverified files must never serve
            raise AdapterRejected(f"{run} v{version}: its checksums could not be checked: {exc!r}") from exc

    async def _unload_quietly(self, run: str, version: int, name: str) -> None:
        """Take back an adapter that is loaded but failed its checksums (it never served);
        if the engine refuses, the unload is retried with the retired versions."""
        try:
            await self.engine.unload_adapter(name)
        except EngineError as exc:
            log.warning("unloading %s after failed checksums failed too (%s); retrying later", name, exc)
            self.unloader.add(name, run, version, routed=False)

    def _check(self, run: str, version: int, path: str | None, max_rank: int) -> Path:
        """The store's checks (paths confined, no symlink, the manifest's files) and the LoRA
        rank against the engine's; returns the adapter directory to load. The checksums are
        checked apart, while the engine loads."""
        try:
            self.store.check(run, version, path=path, only=ADAPTER_DIR)
            config = self.store.adapter_config(run, version)
        except AdapterRejected:
            raise
        except (OSError, ValueError) as exc:
            raise AdapterRejected(f"{run} v{version}: unreadable adapter_config.json: {exc}") from exc
        if not isinstance(config, dict):
            raise AdapterRejected(
                f"{run} v{version}: adapter_config.json is not a JSON object (got {type(config).__name__}); "
                "save the adapter with peft's save_pretrained"
            )
        pattern = config.get("rank_pattern") or {}
        if not isinstance(pattern, dict):
            raise AdapterRejected(
                f"{run} v{version}: adapter_config.json: rank_pattern is not a mapping of module to rank "
                f"({pattern!r:.80}); save the adapter with peft's save_pretrained"
            )
        raw = [config.get("r"), *pattern.values()]
        ranks = [r for r in raw if isinstance(r, int) and r >= 1]
        if len(ranks) != len(raw):
            raise AdapterRejected(f"{run} v{version}: adapter_config.json has no valid LoRA rank 'r' ({raw})")
        if max(ranks) > max_rank:
            raise AdapterRejected(
                f"{run} v{version}: LoRA rank {max(ranks)} is above the engine's max_lora_rank {max_rank}; "
                "train with a smaller rank or raise the engine's --max-lora-rank"
            )
        return self.store.adapter_dir(run, version)

    async def _max_lora_rank(self) -> int:
        """The engine's limit from /server_info, else settings.engine.max_lora_rank."""
        if self._max_rank is None:
            try:
                info = await self.engine.server_info()
            except EngineResponseError as exc:
                log.warning("engine /server_info failed (%s); using settings.engine.max_lora_rank", exc)
                info = {}
            rank = info.get("max_lora_rank")
            if isinstance(rank, int) and rank > 0:
                self._max_rank = rank
            else:
                return self.settings.engine.max_lora_rank
        return self._max_rank

    async def _engine_holds(self, name: str, adapter_dir: Path) -> bool:
        """Whether a refused load was refused because the engine already has this very adapter."""
        held = await self.engine.loaded_adapters()
        return name in held and (not held[name] or Path(held[name]).resolve() == adapter_dir)

    async def _reject(
        self, run: str, version: int | None, message: str, job_id: str | None, *, registered: bool = True
    ) -> None:
        """Append `adapter_rejected`; a registered version refused is not tried again by the
        periodic reconcile until it is registered anew (an event still retries it)."""
        self.metrics.rejections.labels(run if registered else "").inc()
        log.warning("adapter_rejected run=%s version=%s: %s (v%d keeps serving)",
                    run, version, message, self.table.serving(run))
        if registered and version is not None and version >= 1:
            manifest = await asyncio.to_thread(self.registry.manifest, run, version)
            if manifest is not None:
                self._rejected[(run, version)] = manifest.created_at
        event = Event(kind=EventKind.ADAPTER_REJECTED, run=run, version=version, job_id=job_id,
                      data={"message": message})
        await asyncio.to_thread(self.events.append, event)

    def _announce(self, manifest: Manifest, name: str, load_ms: float, ready_to_loaded_ms: float | None) -> None:
        self.registry.set_serving(manifest.run, self.table.serving(manifest.run))
        self.events.append(Event(
            kind=EventKind.ADAPTER_LOADED, run=manifest.run, version=manifest.version, job_id=manifest.job_id,
            data={
                "adapter": name,
                "load_ms": round(load_ms, 3),
                "ready_to_loaded_ms": None if ready_to_loaded_ms is None else round(ready_to_loaded_ms, 3),
                "step": manifest.step,
            },
        ))

    def _write_status(self, run: str) -> None:
        serving, loaded = self.table.serving(run), self.table.loaded(run)
        self.registry.set_serving(run, serving)
        self.conn.set(keys.run_loaded(run), json.dumps(loaded))
        self.metrics.serving.labels(run).set(serving)
        self.metrics.loaded.labels(run).set(len(loaded))

    # unloading --------------------------------------------------------------
    def _retire_old(self, run: str) -> None:
        """Stop routing to versions outside the keep-window; they unload once idle."""
        keep = self.settings.controller.keep_versions
        for version in self.table.loaded(run)[:-keep]:
            name = self.table.adapter(run, version) or adapter_name(run, version)
            busy = self.table.retire(run, version)
            self.unloader.add(name, run, version, routed=True)
            log.info("retiring %s v%d (%s, outside the newest %d; %d requests in flight)",
                     run, version, name, keep, busy)

    async def unload_retired(self) -> None:
        """Unload retired versions that no request uses, and strays; failures are retried later."""
        for run in await self.unloader.unload_idle():
            await asyncio.to_thread(self._write_status, run)

    # status -----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "reconciled": self.reconciled,
            "retiring": sorted(self.unloader.queued),
            "pending_loads": sorted(self._pending),
            "runs": self.table.snapshot(),
        }
