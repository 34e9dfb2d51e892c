"""Loading one adapter version into the engine: checked, loaded under a fresh name, verified, routed.

The store's `check` runs before the engine sees the version (the event's path is the
version's adapter directory, no symlink anywhere, exactly the manifest's files, a valid
adapter_config.json), then the rank is checked against the engine's. The engine loads it under
a name it was never given (`<run>-v<N>`, then `-a1`, `-a2`, ... for later attempts) while the
checksums are checked; only when both succeeded does the run's alias move (routing table, then
registry), and `adapter_loaded` is appended. Any refusal appends `adapter_rejected` and the
previous version keeps serving.

A load the engine does not answer in time is *pending*: it may still complete there, so the
version is not sent again for `PENDING_LOAD_TIMEOUTS` load timeouts (a later reconcile routes
the late completion, or unloads it as a stray). An engine that restarted completes nothing:
then pending loads are forgotten and sent anew.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from tandem.adapters import ADAPTER_DIR, AdapterStore, Manifest
from tandem.errors import AdapterNotVisible, AdapterRejected
from tandem.mounts import filesystem_type, is_local
from tandem.registry import Registry
from tandem.runs import adapter_name, parse_adapter_name
from tandem.settings import InferenceSettings
from tandem_inference.controller.agreement import Held
from tandem_inference.controller.announcements import Announcer
from tandem_inference.controller.metrics import ControllerMetrics
from tandem_inference.controller.slots import Slots
from tandem_inference.controller.unloading import Unloader
from tandem_inference.engines.base import Engine
from tandem_inference.errors import AdapterLoadRefused, EngineClientError, EngineResponseError, EngineTimeout
from tandem_inference.routing import RoutingTable

log = logging.getLogger(__name__)

#: A load that timed out is left to complete in the engine for this many load timeouts before
#: the version is tried again under a new name (a busy engine finishes it; trying sooner would
#: only queue more loads behind it).
PENDING_LOAD_TIMEOUTS = 10
#: A timed-out load the engine never lists is forgotten after this long, in seconds (should it
#: still appear, it is a stray like any other).
PENDING_FORGET_S = 3600.0


class Outcome(Enum):
    LOADED = "loaded"
    REFUSED = "refused"
    """Rejected (an `adapter_rejected` was appended); an older version may be tried."""
    PENDING = "pending"
    """The engine did not answer in time; the load may still complete there."""
    GONE = "gone"
    """The run was deleted while the engine loaded the version; it was taken back and serves nowhere."""


@dataclass
class Pending:
    """A load that timed out; the engine may still complete it."""

    run: str
    version: int
    since: float
    retry_after: float


@dataclass
class Retry:
    """A version refused because the store did not show it (yet): when to try it again."""

    attempts: int
    not_before: float

    @staticmethod
    def after(previous: Retry | None) -> Retry:
        attempts = previous.attempts + 1 if previous is not None else 1
        return Retry(attempts, time.monotonic() + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (attempts - 1)))


RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


class AdapterLoader:
    """Loads versions into the engine and routes to them; remembers refused and pending loads."""

    def __init__(self, settings: InferenceSettings, engine: Engine, store: AdapterStore, table: RoutingTable,
                 registry: Registry, announcer: Announcer, unloader: Unloader, metrics: ControllerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.store = store
        self.table = table
        self.registry = registry
        self.announcer = announcer
        self.unloader = unloader
        self.metrics = metrics
        self.pending: dict[str, Pending] = {}
        """Adapter name -> a load of it that timed out."""
        self.rejected: dict[tuple[str, int], float] = {}
        """(run, version) -> `created_at` of the registered manifest that was refused; the
        periodic reconcile does not try it again until the version is registered anew."""
        self.retries: dict[tuple[str, int], Retry] = {}
        """(run, version) -> when to try again a version the store did not show (AdapterNotVisible:
        a shared store may lag); backoff 1 s doubling to 60 s, never given up."""
        self._max_rank: int | None = None
        self.slots: Slots | None = None
        """Makes room before each load (set by the controller); None: the engine's refusal stands."""
        self.ledger = unloader.ledger
        """The engine's adapters between looks, kept with each load (tandem_inference.controller.ledger)."""
        inline = settings.controller.check_inline
        self.inline_checks = is_local(store.root) if inline is None else inline
        """Whether a version's files are checked on the event loop (`controller.check_inline`)."""
        log.info("a new version's files are checked %s (controller.check_inline=%s; the store %s is on %s)",
                 "on the event loop" if self.inline_checks else "in a thread", inline, store.root,
                 filesystem_type(store.root) or "an unknown filesystem")

    async def load(
        self, run: str, version: int, *, path: str | None = None, ready_ts: float | None = None,
        job_id: str | None = None, announce: bool = True, hold: Callable[[Held], None] | None = None,
        event_ts: float | None = None,
    ) -> Outcome:
        """Check and load one version under a fresh name, then switch the alias -- or, with
        `hold`, hand it over held (loaded, the alias unchanged, nothing announced) for the
        replicas to agree on (tandem_inference.controller.agreement).

        REFUSED (and an `adapter_rejected`) if the version fails a check or the engine refuses
        it; PENDING if the engine did not answer in time. `event_ts`: the `adapter_ready` this load
        answers, when it answers one (its `ts`, the trainer's clock), for the `read` stage.
        """
        t0 = time.monotonic()
        # adapter_ready -> here: the event through Redis, the controller's read of it, the wait for
        # its lock and for the events before it in the page; by two clocks (trainer's, controller's)
        read_ms = (time.time() - event_ts) * 1000 if event_ts is not None else None
        # room is judged by the ledger of the engine's adapters (controller.ledger); where it is not
        # known, the engine's list is asked for while the files are checked: it is on the path only
        # for as long as it outlasts the checks and the attempt's number
        known = self.ledger.names if self.slots is not None and not self.pending else None  # a late load may land
        looked: dict[str, float] = {}
        look = (asyncio.create_task(self._timed_look(looked)) if self.slots is not None and known is None
                else None)
        # the attempt's number is counted in Redis while the files are checked, so a version refused
        # by its checks uses one up (its next load is named `-a1`): a name is only ever new
        # (submitted now, not at the task's first step: checked on the loop, the checks never yield)
        numbered: asyncio.Future[int] | None = None
        try:
            numbered = asyncio.get_running_loop().run_in_executor(None, self.announcer.next_attempt, run, version)
            max_rank = await self._max_lora_rank()
            # on the loop only what stays inside a local store: a link or an event's path that leads
            # elsewhere (another mount, which may hang) is checked, and refused, in a thread
            if self.inline_checks and self.store.plain(run, version, path=path):
                adapter_dir, check_ms = self._timed_check(run, version, path, max_rank)
            else:
                adapter_dir, check_ms = await asyncio.to_thread(self._timed_check, run, version, path, max_rank)
            t_files = time.monotonic()
            attempt = await numbered
        except AdapterRejected as exc:
            await _dropped(look)
            _abandoned(numbered)
            await self.reject(run, version, str(exc), job_id, transient=isinstance(exc, AdapterNotVisible))
            return Outcome.REFUSED
        except BaseException:
            await _dropped(look)
            _abandoned(numbered)
            raise
        name = adapter_name(run, version, attempt)
        t_checked = time.monotonic()
        log.info("adapter_load start run=%s version=%d adapter=%s", run, version, name)
        # the checksums run while the engine loads; the alias switches only when both succeeded
        checksums = asyncio.create_task(asyncio.to_thread(self._timed_verify, run, version))
        refused: AdapterLoadRefused | None = None
        room_ms = 0.0
        sent = False  # whether the load in flight went to the engine (a timeout then leaves it pending)
        try:
            room_ms = await self._make_room(name, look, known)
            try:
                sent = True
                load_ms = await self.ledger.load(self.engine, name, str(adapter_dir))
            except AdapterLoadRefused as exc:
                sent = False
                full = await self._engine_full(name) if self.slots is not None else None
                if full is None:
                    raise
                # the list room was judged by (the ledger, or one read beside the checks) missed an
                # adapter that took a slot since (a load whose outcome was not seen, landing late; one
                # made outside tandem), and the engine's own list is full: room is made from it and
                # the load tried once more before it is refused
                log.info("adapter_load refused run=%s version=%d adapter=%s (%s) with the engine full; making "
                         "room from its list and trying once more", run, version, name, exc)
                room_ms += await self._make_room(name, None, full)
                sent = True
                load_ms = await self.ledger.load(self.engine, name, str(adapter_dir))
        except AdapterLoadRefused as exc:
            load_ms, refused = 0.0, exc
        except EngineTimeout as exc:
            if not sent:  # a list of the engine's adapters timed out: the engine's trouble, not the version's
                raise
            now = time.monotonic()
            retry_s = PENDING_LOAD_TIMEOUTS * self.settings.engine.load_timeout_s
            self.pending[name] = Pending(run, version, since=now, retry_after=now + retry_s)
            self.metrics.load_timeouts.labels(run).inc()
            log.warning("adapter_load timeout run=%s version=%d adapter=%s (%s); if the engine completes it, "
                        "it serves when still the newest, else it is unloaded; no new attempt for %.0f s",
                        run, version, name, exc, retry_s)
            return Outcome.PENDING
        finally:
            (checked,) = await asyncio.gather(checksums, return_exceptions=True)  # never left running
        held = refused is None or await self._engine_holds(name, adapter_dir)
        if isinstance(checked, BaseException):
            if held:
                await self._unload_quietly(run, version, name)
            message = str(checked) if isinstance(checked, AdapterRejected) else repr(checked)
            await self.reject(run, version, message, job_id)  # before the engine's refusal: it names the files
            return Outcome.REFUSED
        if refused is not None and not held:
            await self.reject(run, version, str(refused), job_id)
            return Outcome.REFUSED
        manifest, verify_ms = checked
        t_both = time.monotonic()
        if not self.table.has_run(run):  # deleted while the engine loaded it (its run_deleted was handled)
            log.info("adapter_load gone run=%s version=%d adapter=%s: the run was deleted while it loaded; "
                     "unloading it", run, version, name)
            await self._unload_quietly(run, version, name)
            return Outcome.GONE
        self.table.add_version(run, version, name, serve=hold is None)
        self.rejected.pop((run, version), None)
        self.retries.pop((run, version), None)
        self.metrics.loads.labels(run).inc()
        self.metrics.load_seconds.observe(load_ms / 1000.0)
        ready_to_loaded_ms = (time.time() - ready_ts) * 1000.0 if ready_ts is not None else None
        stages = {"check": (t_files - t0) * 1000, "check_work": check_ms, "attempt": (t_checked - t_files) * 1000,
                  "room": room_ms,
                  "verify": verify_ms, "load_and_verify": (t_both - t_checked) * 1000}
        stages.update(looked)
        if read_ms is not None:
            stages["read"] = read_ms  # negative when the controller's clock is behind the trainer's
        if hold is not None:
            hold(Held(run, version, manifest, name, load_ms, ready_ts, stages))
        elif announce:
            await asyncio.to_thread(self.announcer.loaded, manifest, name, load_ms, ready_to_loaded_ms, stages)
        log.info("adapter_load end run=%s version=%d adapter=%s check_ms=%.1f load_ms=%.1f verify_ms=%.1f "
                 "ready_to_loaded_ms=%s duration_ms=%.1f",
                 run, version, name, stages["check"], load_ms, verify_ms,
                 f"{ready_to_loaded_ms:.1f}" if ready_to_loaded_ms is not None else "-",
                 (time.monotonic() - t0) * 1000)
        return Outcome.LOADED

    async def adopt(self, name: str, path: str, run: str, version: int, *, announce: bool) -> None:
        """Route to an adapter the engine already holds if it was loaded from this version's
        directory for the run registered now, and its files check out; one that fails its checks
        is rejected and unloaded, as is one loaded for a deleted run of the same name (its weights
        are not the files now in that directory).

        `announce`: append `adapter_loaded` (a timed-out load that completed after all)."""
        expected = self.store.adapter_dir(run, version)
        if path and Path(path).resolve() != expected:
            log.warning("engine holds %s from %s, not %s; unloading it", name, path, expected)
            self.unloader.add(name, run, version, routed=False)
            return
        parsed = parse_adapter_name(name)
        floor = await asyncio.to_thread(self.registry.load_attempt_floor, run, version)
        if parsed is not None and parsed[2] < floor:
            log.warning("engine holds %s, loaded for a deleted run named %s (its load attempts of v%d start at %d "
                        "since); unloading it", name, run, version, floor)
            self.unloader.add(name, run, version, routed=False)
            return
        try:
            manifest = await asyncio.to_thread(self._verify, run, version)
        except AdapterRejected as exc:
            log.warning("engine holds %s, but %s; unloading it", name, exc)
            self.unloader.add(name, run, version, routed=False)
            await self.reject(run, version, str(exc), None)
            return
        log.info("adopting %s, already loaded in the engine", name)
        self.table.add_version(run, version, name)
        self.rejected.pop((run, version), None)
        if announce:
            self.metrics.loads.labels(run).inc()
            await asyncio.to_thread(self.announcer.loaded, manifest, name, 0.0, None)

    async def reject(
        self, run: str, version: int | None, message: str, job_id: str | None, *, registered: bool = True,
        transient: bool = False,
    ) -> None:
        """Append `adapter_rejected`; a registered version refused is not tried again by the
        periodic reconcile until it is registered anew (an event still retries it) -- unless the
        refusal is `transient` (the store did not show the version): then it is tried again with
        backoff (`retries`)."""
        self.metrics.rejections.labels(run if registered else "").inc()
        log.warning("adapter_rejected run=%s version=%s: %s (v%d keeps serving)%s",
                    run, version, message, self.table.serving(run),
                    "; the store may lag, so it is tried again" if transient else "")
        if transient and version is not None:
            self.retries[(run, version)] = Retry.after(self.retries.get((run, version)))
        elif registered and version is not None and version >= 1:
            manifest = await asyncio.to_thread(self.registry.manifest, run, version)
            if manifest is not None:
                self.rejected[(run, version)] = manifest.created_at
        await asyncio.to_thread(self.announcer.rejected, run, version, message, job_id)

    def retry_due(self, run: str, version: int) -> bool:
        """Whether a transiently refused version may be tried now (True for any other)."""
        retry = self.retries.get((run, version))
        return retry is None or time.monotonic() >= retry.not_before

    # pending loads ----------------------------------------------------------
    def pending_for(self, run: str, version: int) -> bool:
        """Whether a timed-out load of this version may still complete (so no new one is sent)."""
        now = time.monotonic()
        return any(p.run == run and p.version == version and p.retry_after > now for p in self.pending.values())

    def forget_pending(self, why: str) -> None:
        """No timed-out load can complete in an engine that went away: load those versions anew."""
        if self.pending:
            log.info("forgetting timed-out loads %s: %s", sorted(self.pending), why)
            self.pending.clear()

    def forget_engine(self) -> None:
        """The engine restarted: its limits and adapters are read again and no timed-out load
        completes there."""
        self._max_rank = None
        self.ledger.lost()
        self.forget_pending("the engine restarted")

    def forget_old_pending(self) -> None:
        now = time.monotonic()
        for name, pending in list(self.pending.items()):
            if now - pending.since > PENDING_FORGET_S:
                log.info("forgetting the timed-out load of %s; the engine never listed it", name)
                del self.pending[name]

    # checks -----------------------------------------------------------------
    def _check(self, run: str, version: int, path: str | None, max_rank: int) -> Path:
        """The store's checks (paths confined, no symlink, the manifest's files, a valid
        adapter_config.json) and the LoRA rank against the engine's; returns the adapter
        directory to load. The checksums are checked apart, while the engine loads."""
        self.store.check(run, version, path=path, only=ADAPTER_DIR)
        config = self.store.adapter_config(run, version)
        ranks: list[int] = [config["r"], *(config.get("rank_pattern") or {}).values()]
        if max(ranks) > max_rank:
            raise AdapterRejected(
                f"{run} v{version}: LoRA rank {max(ranks)} is above the engine's max_lora_rank {max_rank}; "
                "train with a smaller rank or raise the engine's --max-lora-rank"
            )
        return self.store.adapter_dir(run, version)

    def _timed_check(self, run: str, version: int, path: str | None, max_rank: int) -> tuple[Path, float]:
        t0 = time.perf_counter()
        return self._check(run, version, path, max_rank), (time.perf_counter() - t0) * 1000

    def _timed_verify(self, run: str, version: int) -> tuple[Manifest, float]:
        t0 = time.perf_counter()
        return self._verify(run, version), (time.perf_counter() - t0) * 1000

    def _verify(self, run: str, version: int) -> Manifest:
        """The checksums of what the engine loads; any failure to check them is a rejection."""
        try:
            return self.store.verify(run, version, only=ADAPTER_DIR)
        except AdapterRejected:
            raise
        except Exception as exc:  # noqa: BLE001 - unverified files must never serve
            raise AdapterRejected(f"{run} v{version}: its checksums could not be checked: {exc!r}") from exc

    async def _engine_full(self, name: str) -> dict[str, str] | None:
        """The engine's adapters, read afresh (into the ledger), where they leave no room for
        `name` (the engine's slots, or its run's); None where there is room."""
        names = await self.ledger.look(self.engine)
        return None if self.slots is None or self.slots.has_room(name, names) else names

    async def _timed_look(self, clock: dict[str, float]) -> dict[str, str]:
        """The engine's adapters, into the ledger; `clock["look"]`: the ms from the call's start
        to its answer read."""
        t0 = time.monotonic()
        try:
            return await self.ledger.look(self.engine)
        finally:
            clock["look"] = (time.monotonic() - t0) * 1000

    async def _make_room(self, name: str, look: asyncio.Task[dict[str, str]] | None,
                         known: dict[str, str] | None) -> float:
        """Room in the engine for one more adapter (tandem_inference.controller.slots: retired
        versions, then the least recently used adapters no request holds, are unloaded; while
        every slot serves a request it waits, up to `controller.slot_wait_s`, then raises
        Overloaded). `known`: the engine's adapters by the ledger; else `look`: asked for beside
        the checks (when it failed, the slots ask again). Returns the ms it took."""
        t0 = time.monotonic()
        if self.slots is not None:
            (seen,) = await asyncio.gather(look, return_exceptions=True) if look is not None else (known,)
            names = None if isinstance(seen, BaseException) else seen
            for touched in await self.slots.make_room(name, names):
                if self.table.has_run(touched):
                    await asyncio.to_thread(self.announcer.write_status, touched)
        return (time.monotonic() - t0) * 1000

    async def _max_lora_rank(self) -> int:
        """The engine's own limit where it says, else settings.engine.max_lora_rank."""
        if self._max_rank is None:
            try:
                rank = (await self.engine.info()).max_lora_rank
            except EngineResponseError as exc:
                log.warning("engine info failed (%s); using settings.engine.max_lora_rank", exc)
                rank = None
            if rank is None:
                return self.settings.engine.max_lora_rank
            self._max_rank = rank
        return self._max_rank

    async def _engine_holds(self, name: str, adapter_dir: Path) -> bool:
        """Whether a refused load was refused because the engine already has this very adapter."""
        held = await self.engine.loaded_adapters()
        return name in held and (not held[name] or Path(held[name]).resolve() == adapter_dir)

    async def _unload_quietly(self, run: str, version: int, name: str) -> None:
        """Take back an adapter that is loaded but failed its checksums (it never served);
        if the engine refuses, the unload is retried with the retired versions."""
        try:
            await self.ledger.unload(self.engine, name)
        except EngineClientError as exc:
            log.warning("unloading %s after failed checksums failed too (%s); retrying later", name, exc)
            self.unloader.add(name, run, version, routed=False)


def _abandoned(future: asyncio.Future[int] | None) -> None:
    """Leave the attempt's number of a load that goes no further to its thread, unwaited (a
    thread cannot be cancelled, and a stalled Redis would hold up the refusal or a cancelled
    load); its error, if any, is read and dropped: it is not the one to report."""
    if future is not None:
        future.add_done_callback(lambda done: done.cancelled() or done.exception())


async def _dropped(task: asyncio.Task[dict[str, str]] | None) -> None:
    """Cancel a look at the engine that is no longer wanted (a hung engine holds up nothing);
    its error, if any, is dropped."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
