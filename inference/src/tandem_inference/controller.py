"""The inference controller: follows the event stream and hot-loads adapter versions.

On start it waits for the engine, then reconciles with the registry (every run's newest
registered version is verified and loaded), so a missed event can never leave a run serving
a stale version. Then it follows `tandem:events` from its persisted cursor, committing after
each event, so a restart neither misses nor repeats work.

For each `adapter_ready` it checks the version before the engine sees it: the event's path
must be the version's adapter directory inside the store, the files must match the manifest
checksums, the LoRA rank must fit the engine. Only after the engine confirmed the load does
the run's alias move (routing table, then registry), and `adapter_loaded` is appended. Any
refusal appends `adapter_rejected` and the previous version keeps serving. Versions that
leave the keep-window stop being routed at once and are unloaded when no request uses them;
a failed unload is retried later and never stops the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem import keys
from tandem.adapters import ADAPTER_DIR, AdapterStore, Manifest
from tandem.errors import AdapterRejected, BackendUnavailable
from tandem.events import Cursor, Event, EventKind, EventStream
from tandem.registry import Registry
from tandem.runs import RUN_NAME, adapter_name
from tandem.settings import InferenceSettings
from tandem_inference.engine_client import EngineClient
from tandem_inference.errors import AdapterLoadError, EngineError, EngineResponseError, EngineUnavailable
from tandem_inference.routing import RoutingTable

log = logging.getLogger("tandem.controller")

_ADAPTER_NAME = re.compile(r"^(?P<run>.+)-v(?P<version>\d+)$")
#: Pause between health checks while waiting for the engine, in seconds (doubles up to the max).
HEALTH_POLL_S = 0.25
HEALTH_POLL_MAX_S = 5.0
#: Longest pause before retrying a failed unload, in seconds.
UNLOAD_RETRY_MAX_S = 60.0
#: Failed unloads of one version after which the engine is restarted (when a restart hook is set).
UNLOAD_FAILURES_BEFORE_RESTART = 3
#: How often the controller checks that the engine still holds what it routes to, in seconds.
ENGINE_CHECK_S = 10.0
#: Pause before the controller starts over after a failure, in seconds.
RESTART_PAUSE_S = 1.0


class ControllerMetrics:
    """Prometheus metrics of the controller, in a registry the caller owns (one per app)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.load_seconds = Histogram(
            "tandem_adapter_load_seconds", "Time the engine took to load one adapter version.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry,
        )
        self.loads = Counter("tandem_adapter_loads", "Adapter versions loaded.", ["run"], registry=registry)
        self.rejections = Counter("tandem_adapter_rejections", "Adapter versions refused.", ["run"],
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


@dataclass
class _Retiring:
    failures: int = 0
    next_try: float = 0.0


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
        self.restart_engine = restart_engine
        self.reconciled = False
        """True once the start-up reconciliation finished (the gateway's /ready needs it)."""
        self._retiring: dict[tuple[str, int], _Retiring] = {}
        self._max_rank: int | None = None
        self._next_engine_check = 0.0
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
            except EngineUnavailable as exc:
                log.warning("engine unavailable (%s); waiting for it, then reconciling", exc)
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
    async def reconcile(self) -> None:
        """Make the engine and the table serve every run's newest registered version.

        Also used after an engine restart: versions the table routes to but the engine lost
        are loaded again, adapters the engine still holds (from before a controller restart)
        are adopted, and the newest registered version of each run is loaded if it is not.
        """
        t0 = time.monotonic()
        async with self._lock:
            self._max_rank = None
            held = await self.engine.loaded_adapters()
            runs = await asyncio.to_thread(self.registry.list_runs)
            for run in runs:
                self.table.add_run(run)
            for run in self.table.runs():
                for version in self.table.loaded(run):
                    if adapter_name(run, version) in held:
                        continue
                    if not await self._load(run, version, announce=False):
                        self.table.retire(run, version)
            for name, path in held.items():
                await self._adopt(name, path, runs)
            for run in runs:
                manifests = await asyncio.to_thread(self.registry.manifests, run)
                for manifest in reversed(manifests):
                    if manifest.version <= self.table.serving(run):
                        break
                    if await self._load(run, manifest.version, ready_ts=manifest.created_at,
                                        job_id=manifest.job_id):
                        break
                self._retire_old(run)
                await asyncio.to_thread(self._write_status, run)
        self.reconciled = True
        log.info("reconcile end runs=%d duration_ms=%.1f serving=%s", len(runs),
                 (time.monotonic() - t0) * 1000, {r: self.table.serving(r) for r in runs})

    async def _adopt(self, name: str, path: str, runs: list[str]) -> None:
        """Route to an adapter the engine already holds if it is a version of a known run,
        loaded from that version's directory; one whose files fail their checksums is unloaded."""
        m = _ADAPTER_NAME.match(name)
        if not m or m.group("run") not in runs:
            return
        run, version = m.group("run"), int(m.group("version"))
        expected = self.store.adapter_dir(run, version)
        if path and Path(path).resolve() != expected:
            log.warning("engine holds %s from %s, not %s; not routing to it", name, path, expected)
            return
        if version not in self.table.loaded(run):
            try:
                await asyncio.to_thread(self._verify, run, version)
            except AdapterRejected as exc:
                log.warning("engine holds %s, but %s; unloading it", name, exc)
                self._retiring.setdefault((run, version), _Retiring())
                return
            log.info("adopting %s, already loaded in the engine", name)
            self.table.add_version(run, version)
            self._retiring.pop((run, version), None)

    # the event stream -------------------------------------------------------
    async def follow(self) -> None:
        """Handle events after the persisted cursor, forever; commit after each."""
        after = await asyncio.to_thread(self.cursor.get)
        block_ms = self.settings.controller.block_ms
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
            await self._check_engine()

    async def _check_engine(self) -> None:
        """Reconcile when the engine lost adapters the table routes to (it restarted)."""
        now = time.monotonic()
        if now < self._next_engine_check:
            return
        self._next_engine_check = now + ENGINE_CHECK_S
        held = await self.engine.loaded_adapters()
        lost = [adapter_name(run, v) for run in self.table.runs() for v in self.table.loaded(run)
                if adapter_name(run, v) not in held]
        if lost:
            log.warning("engine lost adapters %s (restarted?); reconciling", lost)
            await self.reconcile()

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
                          event.id, event.kind, event.run, event.version)

    async def _on_ready(self, event: Event) -> None:
        run, version = event.run, event.version
        if RUN_NAME.match(run):
            self.table.add_run(run)
        if version is None or version < 1:
            message = f"adapter_ready for {run!r} carries no valid version ({version})"
            await self._reject(run, version, message, event.job_id)
            return
        serving = self.table.serving(run)
        if serving >= version:
            log.info("skipping %s v%d: v%d already serves", run, version, serving)
            return
        path = event.data.get("path")
        if path is not None and not isinstance(path, str):
            message = f"{run} v{version}: data.path {path!r} is not a string"
            await self._reject(run, version, message, event.job_id)
            return
        if await self._load(run, version, path=path, ready_ts=event.ts, job_id=event.job_id):
            self._retire_old(run)  # unloaded by the follow loop, outside the lock
            await asyncio.to_thread(self._write_status, run)

    # loading ----------------------------------------------------------------
    async def _load(
        self, run: str, version: int, *, path: str | None = None, ready_ts: float | None = None,
        job_id: str | None = None, announce: bool = True,
    ) -> bool:
        """Check and load one version, then switch the alias; False (and an event) if refused."""
        name = adapter_name(run, version)
        t0 = time.monotonic()
        log.info("adapter_load start run=%s version=%d adapter=%s", run, version, name)
        try:
            max_rank = await self._max_lora_rank()
            adapter_dir = await asyncio.to_thread(self._check, run, version, path, max_rank)
            # the checksums run while the engine loads; the alias switches only when both succeeded
            checksums = asyncio.create_task(asyncio.to_thread(self._verify, run, version))
            refused: AdapterLoadError | None = None
            try:
                load_ms = await self.engine.load_adapter(name, str(adapter_dir))
            except AdapterLoadError as exc:
                load_ms, refused = 0.0, exc
            finally:
                (checked,) = await asyncio.gather(checksums, return_exceptions=True)  # never left running
            held = refused is None or await self._engine_holds(name, adapter_dir)
            if isinstance(checked, BaseException):
                if held:
                    await self._unload_quietly(run, version)
                raise checked  # before the engine's refusal: it says what is wrong with the files
            if refused is not None and not held:
                raise refused
            manifest = checked
        except (AdapterRejected, AdapterLoadError) as exc:
            await self._reject(run, version, str(exc), job_id)
            return False
        self.table.add_version(run, version)
        self.metrics.loads.labels(run).inc()
        self.metrics.load_seconds.observe(load_ms / 1000.0)
        ready_to_loaded_ms = (time.time() - ready_ts) * 1000.0 if ready_ts is not None else None
        if announce:
            await asyncio.to_thread(self._announce, manifest, load_ms, ready_to_loaded_ms)
        log.info("adapter_load end run=%s version=%d adapter=%s load_ms=%.1f ready_to_loaded_ms=%s "
                 "duration_ms=%.1f",
                 run, version, name, load_ms,
                 f"{ready_to_loaded_ms:.1f}" if ready_to_loaded_ms is not None else "-",
                 (time.monotonic() - t0) * 1000)
        return True

    def _verify(self, run: str, version: int) -> Manifest:
        """The checksums of what the engine loads; any failure to check them is a rejection."""
        try:
            return self.store.verify(run, version, only=ADAPTER_DIR)
        except AdapterRejected:
            raise
        except Exception as exc:  # noqa: BLE001 - unverified files must never serve
            raise AdapterRejected(f"{run} v{version}: its checksums could not be checked: {exc!r}") from exc

    async def _unload_quietly(self, run: str, version: int) -> None:
        """Take back an adapter that is loaded but failed its checksums (it never served);
        if the engine refuses, the unload is retried with the retired versions."""
        name = adapter_name(run, version)
        try:
            await self.engine.unload_adapter(name)
        except EngineError as exc:
            log.warning("unloading %s after failed checksums failed too (%s); retrying later", name, exc)
            self._retiring.setdefault((run, version), _Retiring())

    def _check(self, run: str, version: int, path: str | None, max_rank: int) -> Path:
        """Path inside the store and equal to the version's adapter dir, manifest, rank (the
        checksums are checked apart, while the engine loads)."""
        expected = self.store.adapter_dir(run, version)
        if path is not None:
            resolved = self.store.resolve(path)
            if resolved != expected:
                raise AdapterRejected(
                    f"{run} v{version}: event path {path!r} resolves to {resolved}, not the version's "
                    f"adapter directory {expected}"
                )
        manifest = self.store.read_manifest(run, version)
        if manifest.run != run or manifest.version != version:
            raise AdapterRejected(f"{run} v{version}: its manifest says {manifest.run} v{manifest.version}")
        for rel in manifest.files:
            if rel.startswith(f"{ADAPTER_DIR}/") and not (expected.parent / rel).is_file():
                raise AdapterRejected(f"{run} v{version}: file {rel} is missing")
        try:
            config = self.store.adapter_config(run, version)
        except (OSError, ValueError) as exc:
            raise AdapterRejected(f"{run} v{version}: unreadable adapter_config.json: {exc}") from exc
        raw = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
        ranks = [r for r in raw if isinstance(r, int) and r >= 1]
        if len(ranks) != len(raw):
            raise AdapterRejected(f"{run} v{version}: adapter_config.json has no valid LoRA rank 'r' ({raw})")
        if max(ranks) > max_rank:
            raise AdapterRejected(
                f"{run} v{version}: LoRA rank {max(ranks)} is above the engine's max_lora_rank {max_rank}; "
                "train with a smaller rank or raise the engine's --max-lora-rank"
            )
        return expected

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

    async def _reject(self, run: str, version: int | None, message: str, job_id: str | None) -> None:
        self.metrics.rejections.labels(run).inc()
        log.warning("adapter_rejected run=%s version=%s: %s (v%d keeps serving)",
                    run, version, message, self.table.serving(run))
        event = Event(kind=EventKind.ADAPTER_REJECTED, run=run, version=version, job_id=job_id,
                      data={"message": message})
        await asyncio.to_thread(self.events.append, event)

    def _announce(self, manifest: Manifest, load_ms: float, ready_to_loaded_ms: float | None) -> None:
        self.registry.set_serving(manifest.run, self.table.serving(manifest.run))
        self.events.append(Event(
            kind=EventKind.ADAPTER_LOADED, run=manifest.run, version=manifest.version, job_id=manifest.job_id,
            data={
                "adapter": manifest.adapter_name,
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
            busy = self.table.retire(run, version)
            self._retiring.setdefault((run, version), _Retiring())
            log.info("retiring %s v%d (outside the newest %d; %d requests in flight)",
                     run, version, keep, busy)

    async def unload_retired(self) -> None:
        """Unload retired versions that no request uses; failures are retried later."""
        now = time.monotonic()
        touched: set[str] = set()
        for (run, version), state in list(self._retiring.items()):
            if version in self.table.loaded(run):  # routed again since: never unload what serves
                del self._retiring[(run, version)]
                continue
            if state.next_try > now or self.table.in_flight(run, version) > 0:
                continue
            name = adapter_name(run, version)
            t0 = time.monotonic()
            try:
                await self.engine.unload_adapter(name)
            except EngineError as exc:
                if isinstance(exc, EngineResponseError) and await self._gone(name):
                    log.info("%s was no longer loaded in the engine (%s)", name, exc)
                else:
                    await self._unload_failed(run, version, state, exc)
                    continue
            del self._retiring[(run, version)]
            touched.add(run)
            self.metrics.unloads.labels(run, "ok").inc()
            log.info("adapter_unload end run=%s version=%d adapter=%s duration_ms=%.1f",
                     run, version, name, (time.monotonic() - t0) * 1000)
        for run in touched:
            await asyncio.to_thread(self._write_status, run)

    async def _gone(self, name: str) -> bool:
        try:
            return name not in await self.engine.loaded_adapters()
        except EngineError:
            return False

    async def _unload_failed(self, run: str, version: int, state: _Retiring, exc: EngineError) -> None:
        state.failures += 1
        pause = min(UNLOAD_RETRY_MAX_S, 2.0 ** state.failures)
        state.next_try = time.monotonic() + pause
        self.metrics.unloads.labels(run, "failed").inc()
        log.warning("unload of %s v%d failed (%s); attempt %d, retrying in %.0f s",
                    run, version, exc, state.failures, pause)
        # NOTE: SGLang 0.5.x unload can hang after n>1 sampling (#36894) or on a leaked use
        # count (#34205); a restart of the engine (which reloads what serves) is the way out.
        if self.restart_engine is not None and state.failures >= UNLOAD_FAILURES_BEFORE_RESTART:
            try:
                reason = f"unload of {adapter_name(run, version)} failed {state.failures} times"
                await self.restart_engine(reason)
            except Exception:  # noqa: BLE001 - a failed restart is logged; the next failure tries again
                log.exception("engine restart after failed unloads did not work")

    # status -----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "reconciled": self.reconciled,
            "retiring": [f"{run}@v{v}" for run, v in sorted(self._retiring)],
            "runs": self.table.snapshot(),
        }
