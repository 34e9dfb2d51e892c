"""Engine slots: more adapter versions than the engine holds, served by loading on demand.

The engine holds at most `engine.max_loaded_adapters` adapters (its slots; SGLang's
`--max-loaded-loras`, vLLM's `--max-cpu-loras`). Many runs on one base model, each with its
recent versions, ask for more. Before any load the controller makes room here: retired versions
no request holds are unloaded first, then the least recently used adapter that no request holds
is evicted (RoutingTable.evict_idle: taken out of the routable set and unloaded, in one step
with respect to checkouts, so what a request uses is never unloaded). When every slot serves a
request in flight, the load waits for one to end, up to `controller.slot_wait_s`; past it the
load fails with `Overloaded` (`adapter_slots`): the gateway answers 429 with Retry-After.

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
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

from tandem_inference.controller.unloading import Unloader
from tandem_inference.engines.base import Engine
from tandem_inference.errors import EngineClientError, Overloaded
from tandem_inference.routing import RoutingTable

log = logging.getLogger(__name__)

#: Pause between looks for a free slot while every slot serves a request, in seconds.
SLOT_POLL_S = 0.01
#: Retry-After of a request refused because no slot came free in time, in seconds.
SLOT_RETRY_AFTER_S = 1


class Slots:
    """Makes room in the engine for one more adapter: unload retired, evict by recency, or wait."""

    def __init__(self, engine: Engine, table: RoutingTable, unloader: Unloader, *, limit: int, wait_s: float,
                 evictions: Counter) -> None:
        self.engine = engine
        self.table = table
        self.unloader = unloader
        self.limit = limit
        """The engine's slots (`engine.max_loaded_adapters`)."""
        self.wait_s = wait_s
        """Longest wait for a slot while every one serves a request (`controller.slot_wait_s`)."""
        self.evictions = evictions
        """Counter of adapters evicted for room, labelled run."""
        self.advance: Callable[[], Awaitable[None]] | None = None
        """Serves the held versions the replicas agree on (set by the controller): a held version
        is never evicted, so when only held ones are left, serving them frees the older ones."""

    async def make_room(self, for_adapter: str) -> set[str]:
        """Return once the engine holds fewer than `limit` adapters; returns the runs that lost
        one (their status is to be written). Overloaded when no slot came free within `wait_s`."""
        deadline = time.monotonic() + self.wait_s
        touched: set[str] = set()
        waited = False
        while True:
            held = await self._held_count()
            if held < self.limit:
                if waited:
                    log.info("a slot came free for %s", for_adapter)
                return touched
            touched |= await self.unloader.unload_idle()  # retired versions no request holds go first
            if await self._held_count() < self.limit:
                continue
            victim = self.table.evict_idle()
            if victim is None and self.advance is not None and self._any_held():
                await self.advance()
                victim = self.table.evict_idle()
            if victim is not None:
                await self._evict(*victim)
                touched.add(victim[0])
                continue
            if time.monotonic() >= deadline:
                raise Overloaded(
                    f"the engine's {self.limit} adapter slots (engine.max_loaded_adapters) all serve requests in "
                    f"flight, and none came free within {self.wait_s:g} s (controller.slot_wait_s) to load "
                    f"{for_adapter}; retry after {SLOT_RETRY_AFTER_S} s, or raise TANDEM_ENGINE__MAX_LOADED_ADAPTERS",
                    reason="adapter_slots", retry_after_s=SLOT_RETRY_AFTER_S)
            if not waited:
                log.info("every one of the engine's %d slots serves a request; %s waits for one", self.limit,
                         for_adapter)
                waited = True
            await asyncio.sleep(SLOT_POLL_S)

    async def _evict(self, run: str, version: int, name: str) -> None:
        """Unload an adapter taken out of routing for room; a failed unload is retried by the
        unloader (it keeps its slot until then)."""
        t0 = time.monotonic()
        try:
            await self.engine.unload_adapter(name)
        except EngineClientError as exc:
            log.warning("evicting %s failed (%s); the unloader retries it", name, exc)
            self.unloader.add(name, run, version, routed=False)
            return
        self.evictions.labels(run).inc()
        log.info("adapter_evict end run=%s version=%d adapter=%s duration_ms=%.1f (least recently used, idle)",
                 run, version, name, (time.monotonic() - t0) * 1000)

    def _any_held(self) -> bool:
        return any(self.table.held(run) for run in self.table.runs())

    async def _held_count(self) -> int:
        """Adapters the engine holds (its own list: strays and retired ones take slots too)."""
        return len(await self.engine.loaded_adapters())
