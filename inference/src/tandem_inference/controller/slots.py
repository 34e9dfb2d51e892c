"""Engine slots: more adapter versions than the engine holds, served by loading on demand.

The engine holds at most `engine.max_loaded_adapters` adapters (its slots; SGLang's
`--max-loaded-loras`, vLLM's `--max-cpu-loras`). Many runs on one base model, each with its recent
versions, ask for more. Before any load the controller makes room here: retired versions no
request holds are unloaded first, then the least recently used adapter that no request holds is
evicted (RoutingTable.evict_idle: taken out of the routable set and unloaded, in one step with
respect to checkouts, so what a request uses is never unloaded). When every slot serves a
request in flight and none went idle within `DRAIN_AFTER_S`, the least recently used adapter is
drained (RoutingTable.drain_lru): taken out of the routable set while its requests go on, so
that new requests for it load it again on demand, and unloaded once its last request ends.
Without the drain, more busy runs than slots starve a load: each adapter gets its next request
before its last one ends and never goes idle (on one GPU with 32 runs through 8 slots, a
version waited 316 s for its load). The load waits for the drained slot up to
`controller.slot_wait_s`; past it the load fails with `Overloaded` (`adapter_slots`): the
gateway answers 429 with Retry-After.

A run has a quota of its own, `controller.run_max_loaded_adapters`: before the engine's slots are
counted, a run that already holds that many adapters (by the engine's own list, so retired ones
not yet unloaded count too) makes room among its own: its retired versions no request holds go,
then its own least recently used idle adapter is evicted, never another run's. When each of its
adapters serves a request in flight, the load waits for one of them, within the same
`controller.slot_wait_s`; past it the load fails with `Overloaded` (`run_adapter_slots`). So one run
with many versions asked for at once cycles them through its K slots and leaves the others' alone.

Versions newer than their run serves (held while the replicas agree) are never evicted; when
only they are left, the ones the replicas agree on are served first (the versions they replace
become evictable). A run's
serving version that was evicted still is what `<run>` means: a request for it (or for any
registered version `<run>@vN`) that finds it not loaded has it loaded again on demand
(Controller.checkout_on_demand), under a fresh name, checked as any load is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import Counter

from tandem.runs import parse_adapter_name
from tandem_inference.controller.unloading import Unloader
from tandem_inference.engines.base import Engine
from tandem_inference.errors import EngineClientError, Overloaded
from tandem_inference.routing import RoutingTable

log = logging.getLogger(__name__)

#: Pause between looks for a free slot while every slot serves a request, in seconds.
SLOT_POLL_S = 0.01
#: Retry-After of a request refused because no slot came free in time, in seconds.
SLOT_RETRY_AFTER_S = 1
#: How long a load looks for an adapter going idle by itself before it drains one, in seconds: under
#: moderate load one usually does within a request's time, and a drain costs its run a reload.
DRAIN_AFTER_S = 1.0


class Slots:
    """Makes room in the engine for one more adapter: unload retired, evict by recency, or wait."""

    def __init__(self, engine: Engine, table: RoutingTable, unloader: Unloader, *, limit: int, wait_s: float,
                 evictions: Counter, run_limit: int | None = None) -> None:
        self.engine = engine
        self.ledger = unloader.ledger
        """The engine's adapters between looks, kept with the unloader's unloads and the loads."""
        self.table = table
        self.unloader = unloader
        self.limit = limit
        """The engine's slots (`engine.max_loaded_adapters`)."""
        self.run_limit = run_limit or limit
        """The slots one run's adapters may take (`controller.run_max_loaded_adapters`)."""
        self.wait_s = wait_s
        """Longest wait for a slot while every one serves a request (`controller.slot_wait_s`)."""
        self.evictions = evictions
        """Counter of adapters evicted for room, labelled run."""
        self.advance: Callable[[], Awaitable[None]] | None = None
        """Serves the held versions the replicas agree on (set by the controller): a held version
        is never evicted, so when only held ones are left, serving them frees the older ones."""

    async def make_room(self, for_adapter: str, seen: Mapping[str, str] | None = None) -> set[str]:
        """Return once the engine holds fewer than `limit` adapters (and the adapter's run fewer than
        `run_limit`); returns the runs that lost one (their status is to be written). Overloaded
        when no slot came free within `wait_s`. `seen`: the engine's adapters as the controller
        knows them (its ledger, tandem_inference.controller.ledger, or the engine's list asked for
        beside the load's checks). A list with room for the adapter is enough; a full one is not
        trusted (a slot may have come free since), so the engine is asked again before anything
        is unloaded, and after anything is unloaded or waited for.

        A list with room may have missed an adapter that took a slot since it was read (a load
        whose outcome the controller never saw, landing late; one made outside tandem): the engine
        then refuses the load, and where its own list is full the loader makes room from it and
        tries once more (AdapterLoader.load)."""
        parsed = parse_adapter_name(for_adapter)
        if seen is not None and self.has_room(for_adapter, seen):
            return set()  # room in the list: nothing to unload (a full list is asked for afresh below)
        deadline = time.monotonic() + self.wait_s
        drain_at = time.monotonic() + DRAIN_AFTER_S
        touched: set[str] = set()
        if parsed is not None and self.run_limit < self.limit:
            touched |= await self._room(for_adapter, parsed[0], deadline, drain_at)
        return touched | await self._room(for_adapter, None, deadline, drain_at)

    def has_room(self, for_adapter: str, names: Mapping[str, str]) -> bool:
        """Whether the engine holding `names` has a slot for `for_adapter`, within its run's quota."""
        parsed = parse_adapter_name(for_adapter)
        return _held(names, None) < self.limit and (parsed is None or _held(names, parsed[0]) < self.run_limit)

    async def _room(self, for_adapter: str, run: str | None, deadline: float, drain_at: float) -> set[str]:
        """Return once the engine holds fewer adapters than its slots, or, with `run`, the run fewer
        than its quota of them: retired versions no request holds are unloaded first, then the least
        recently used idle adapter (the run's own, with `run`) is evicted, then one is drained; past
        `deadline`, Overloaded. Returns the runs that lost an adapter."""
        limit = self.limit if run is None else self.run_limit
        touched: set[str] = set()
        waited = drained = False
        while True:
            held = await self._count(run)
            if held < limit:
                if waited:
                    log.info("a slot came free for %s", for_adapter)
                return touched
            unloaded = await self.unloader.unload_idle()  # retired versions no request holds go first
            touched |= unloaded
            if unloaded and await self._count(run) < limit:
                continue
            victim = self.table.evict_idle(run=run)
            if victim is None and self.advance is not None and self._any_held(run):
                await self.advance()
                victim = self.table.evict_idle(run=run)
            if victim is not None:
                await self._evict(*victim)
                touched.add(victim[0])
                continue
            if not drained and time.monotonic() >= drain_at:
                drained = self._drain(for_adapter, run=run)
                if drained:
                    continue
            if time.monotonic() >= deadline:
                raise self._overloaded(for_adapter, run, held)
            if not waited:
                if run is None:
                    log.info("every one of the engine's %d slots serves a request; %s waits for one", limit,
                             for_adapter)
                else:
                    log.info("run %s holds its %d slots, each serving a request; %s waits for one", run, limit,
                             for_adapter)
                waited = True
            await asyncio.sleep(SLOT_POLL_S)

    def _overloaded(self, for_adapter: str, run: str | None, held: int) -> Overloaded:
        """The refusal of a load that found no slot within `wait_s`: the engine's, or `run`'s quota."""
        if run is None:
            return Overloaded(
                f"the engine's {self.limit} adapter slots (engine.max_loaded_adapters) all serve requests in "
                f"flight, and none came free within {self.wait_s:g} s (controller.slot_wait_s) to load "
                f"{for_adapter}; retry after {SLOT_RETRY_AFTER_S} s, or raise TANDEM_ENGINE__MAX_LOADED_ADAPTERS",
                reason="adapter_slots", retry_after_s=SLOT_RETRY_AFTER_S)
        return Overloaded(
            f"run {run!r} holds {held} adapters, its quota of engine slots "
            f"(controller.run_max_loaded_adapters={self.run_limit}), and each serves requests in flight; "
            f"none came free within {self.wait_s:g} s (controller.slot_wait_s) to load {for_adapter}; "
            f"retry after {SLOT_RETRY_AFTER_S} s, or raise TANDEM_CONTROLLER__RUN_MAX_LOADED_ADAPTERS",
            reason="run_adapter_slots", retry_after_s=SLOT_RETRY_AFTER_S)

    async def _count(self, run: str | None) -> int:
        """Adapters the engine holds (its own list: strays and retired ones take slots too), or,
        with `run`, those of that run."""
        return _held(await self.ledger.look(self.engine), run)

    def _drain(self, for_adapter: str, *, run: str | None = None) -> bool:
        """Drain the least recently used adapter (of `run` only, when given) for `for_adapter`:
        out of routing now, queued to unload once its requests end. False when no drain is needed
        (a retired or drained adapter is queued to unload already: its slot comes free) or none can
        be drained (every routable adapter is held: newer than its run serves)."""
        if self.unloader.coming_free(run):
            return False
        victim = self.table.drain_lru(run=run)
        if victim is None:
            return False
        name = victim[2]
        self.unloader.add(name, victim[0], victim[1], routed=True)
        self.evictions.labels(victim[0]).inc()
        log.info("adapter_drain run=%s version=%d adapter=%s requests_in_flight=%d: every slot serves requests, "
                 "so %s takes this least recently used one once they end", victim[0], victim[1], name,
                 self.table.in_flight_adapter(name), for_adapter)
        return True

    async def _evict(self, run: str, version: int, name: str) -> None:
        """Unload an adapter taken out of routing for room; a failed unload is retried by the
        unloader (it keeps its slot until then)."""
        t0 = time.monotonic()
        try:
            await self.ledger.unload(self.engine, name)
        except EngineClientError as exc:
            log.warning("evicting %s failed (%s); the unloader retries it", name, exc)
            self.unloader.add(name, run, version, routed=False)
            return
        self.evictions.labels(run).inc()
        log.info("adapter_evict end run=%s version=%d adapter=%s duration_ms=%.1f (least recently used, idle)",
                 run, version, name, (time.monotonic() - t0) * 1000)

    def _any_held(self, run: str | None) -> bool:
        """Whether a version newer than its run serves is held (of `run` only, when given)."""
        return any(self.table.held(r) for r in ([run] if run is not None else self.table.runs()))


def _held(names: Mapping[str, str], run: str | None) -> int:
    """How many of the engine's adapters `names` take a slot: all, or, with `run`, that run's."""
    if run is None:
        return len(names)
    return sum(1 for name in names if (parsed := parse_adapter_name(name)) is not None and parsed[0] == run)
