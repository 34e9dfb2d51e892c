"""Unloading adapters from the engine: retired versions once idle, and strays.

The controller queues two kinds of adapter here: versions it retired from routing (outside
the keep-window), which may still serve requests that checked them out before, so they are
unloaded only once none is in flight; and strays, which nothing ever routed to (a load that
completed after its timeout, an adapter whose files failed their checks), unloaded at once.
An adapter routed again meanwhile is never unloaded. A failed unload is retried with backoff;
after repeated failures the engine is restarted (it then reloads what serves).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Counter

from tandem.runs import adapter_name
from tandem_inference.controller.ledger import Ledger
from tandem_inference.engines.base import Engine
from tandem_inference.errors import EngineClientError, EngineResponseError
from tandem_inference.routing import RoutingTable

log = logging.getLogger(__name__)

#: Longest pause before retrying a failed unload, in seconds.
UNLOAD_RETRY_MAX_S = 60.0
#: Failed unloads of one adapter after which the engine is restarted (when a restart hook is set).
UNLOAD_FAILURES_BEFORE_RESTART = 3


@dataclass
class Retiring:
    """One adapter to unload."""

    run: str
    version: int
    routed: bool
    """Whether requests may hold it (a retired version); then it waits until none does."""
    failures: int = 0
    next_try: float = 0.0


class Unloader:
    """The adapters waiting to be unloaded, by engine-side name."""

    def __init__(
        self,
        engine: Engine,
        table: RoutingTable,
        unloads: Counter,
        restart_engine: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.engine = engine
        self.table = table
        self.unloads = unloads
        """Counter of unload attempts, labelled run and outcome."""
        self.restart_engine = restart_engine
        self.queued: dict[str, Retiring] = {}
        self.ledger = Ledger()
        """The engine's adapters between looks (tandem_inference.controller.ledger), kept with each unload."""

    def add(self, name: str, run: str, version: int, *, routed: bool) -> None:
        """Queue `name` (a version of `run`) for unloading; queuing it twice changes nothing."""
        self.queued.setdefault(name, Retiring(run, version, routed))

    def retire_old(self, run: str, keep: int) -> None:
        """Stop routing to the run's versions outside the newest `keep` up to the serving one
        (held versions newer than it stay; versions evicted for room count in the window); they
        unload once idle."""
        serving = self.table.serving(run)
        window = sorted(v for v in {*self.table.loaded(run), *self.table.evicted(run)} if v <= serving)[-keep:]
        if window:
            self.table.forget_evicted(run, below=window[0])
        for version in [v for v in self.table.loaded(run) if v <= serving and v not in window]:
            name = self.table.adapter(run, version) or adapter_name(run, version)
            busy = self.table.retire(run, version)
            self.add(name, run, version, routed=True)
            log.info("retiring %s v%d (%s, outside the newest %d; %d requests in flight)",
                     run, version, name, keep, busy)

    def coming_free(self, run: str | None = None) -> bool:
        """Whether an adapter (of `run` only, when given) is queued to unload once its requests end:
        its slot comes free without another drain."""
        return any(state.routed and (run is None or state.run == run) for state in self.queued.values())

    def __contains__(self, name: object) -> bool:
        return name in self.queued

    async def unload_idle(self) -> set[str]:
        """Unload what is queued and no request uses; returns the runs that lost an adapter."""
        now = time.monotonic()
        touched: set[str] = set()
        for name, state in list(self.queued.items()):
            run, version = state.run, state.version
            if self.table.adapter(run, version) == name:  # routed again since: never unload what serves
                del self.queued[name]
                continue
            if state.next_try > now or (state.routed and self.table.in_flight_adapter(name) > 0):
                continue
            t0 = time.monotonic()
            try:
                await self.ledger.unload(self.engine, name)
            except EngineClientError as exc:
                if isinstance(exc, EngineResponseError) and await self._gone(name):
                    log.info("%s was no longer loaded in the engine (%s)", name, exc)
                else:
                    await self._failed(name, state, exc)
                    continue
            self.queued.pop(name, None)  # a concurrent call (making room for a load) may have unloaded it too
            touched.add(run)
            self.unloads.labels(run, "ok").inc()
            log.info("adapter_unload end run=%s version=%d adapter=%s duration_ms=%.1f",
                     run, version, name, (time.monotonic() - t0) * 1000)
        return touched

    async def _gone(self, name: str) -> bool:
        try:
            return name not in await self.engine.loaded_adapters()
        except EngineClientError:
            return False

    async def _failed(self, name: str, state: Retiring, exc: EngineClientError) -> None:
        state.failures += 1
        pause = min(UNLOAD_RETRY_MAX_S, 2.0 ** state.failures)
        state.next_try = time.monotonic() + pause
        self.unloads.labels(state.run, "failed").inc()
        log.warning("unload of %s failed (%s); attempt %d, retrying in %.0f s", name, exc, state.failures, pause)
        # NOTE: SGLang 0.5.x unload can hang after n>1 sampling (sglang#36894) or on a leaked
        # use count (sglang#34205); a restart of the engine (which reloads what serves) is the way out.
        if self.restart_engine is not None and state.failures >= UNLOAD_FAILURES_BEFORE_RESTART:
            try:
                await self.restart_engine(f"unload of {name} failed {state.failures} times")
            except Exception:  # noqa: BLE001 - a failed restart is logged; the next failure tries again
                log.exception("engine restart after failed unloads did not work")
