"""The routing table: which adapter version serves a gateway `model`, held in memory.

The controller and the gateway run in one process so that a version switch is a change to
this table, not a Redis round trip per request. Per run it holds the loaded versions and
the one the run's alias points at (the newest, or an older one while a newer one waits for the
other replicas to hold it: tandem_inference.controller.agreement), per version the number of requests in
flight, so the controller unloads a version only once nothing uses it.

Model strings the gateway accepts:

    <base model name>   the base model, no run (version 0); wins over a run of the same name
    <run>               the run's serving version; version 0 (the base model) until one loads
    <run>@v7, <run>@7   that version, which must be loaded (v0 = the base model)

Rules that keep routing safe: a run enters the table only from the registry (an event alone
never makes a run) and leaves it when it is deleted (its versions then unload once idle), a
version enters it only after the engine confirmed its load, under the adapter name that load
used (so an alias never points at a version the engine lacks), and leaves the routable set
before it is unloaded (so no request is sent to an unloaded version; SGLang would reload
it silently from disk). Resolution and acquire happen under one lock, without awaiting, so
the controller cannot retire a version between the two.

Engine slots (`engine.max_loaded_adapters`) may be far fewer than the versions asked for. The
table remembers when each loaded version was last checked out, and `evict_idle` takes the least
recently used one that no request holds out of the routable set, atomically with checkout, so an
adapter a request uses is never evicted. A run's serving version that was evicted still is what
`<run>` means: resolving it, like resolving a pinned version that is not loaded, raises
`NotResident`, and the gateway has the controller load it on demand
(tandem_inference.controller.slots).
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from tandem.runs import RUN_NAME, adapter_name
from tandem_inference.errors import ModelNotFound, NotResident

_PINNED = re.compile(r"^(?P<run>[^@]+)@v?(?P<version>0|[1-9][0-9]{0,17})$")


@dataclass(frozen=True)
class Route:
    """Where one request goes: a run (or none for the bare base model) and a version.

    Routes compare (and count in flight) by run and version; `adapter` is the engine-side name
    the version was loaded under, None for version 0 (the base model).
    """

    run: str | None
    version: int
    adapter: str | None = field(default=None, compare=False)

    def name(self, base_model: str) -> str:
        """Canonical model string of this route: `run@vN`, or the base model's name."""
        return f"{self.run}@v{self.version}" if self.run is not None else base_model


class VersionHold:
    """One request's use of a version, counted in flight until released; releasing twice is harmless."""

    def __init__(self, table: RoutingTable, route: Route) -> None:
        self.table = table
        self.route = route
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.table._release(self.route)

    def __enter__(self) -> VersionHold:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def parse_model(model: str) -> tuple[str, int | None]:
    """Split `run@v7` / `run@7` into (run, 7) and `run` into (run, None)."""
    m = _PINNED.fullmatch(model)
    if m:
        return m.group("run"), int(m.group("version"))
    return model, None


def named_run(model: str) -> str:
    """The run a model string names: `run` of `run@v7`, and of `run@<anything>` (a malformed version)."""
    return model.split("@", 1)[0]


class RoutingTable:
    """Runs, their loaded versions and in-flight counts; safe to use from several threads."""

    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self._lock = threading.Lock()
        self._runs: set[str] = set()
        self._loaded: dict[str, dict[int, str]] = defaultdict(dict)  # run -> version -> adapter name
        self._alias: dict[str, int] = {}  # run -> newest version the alias may point at
        self._in_flight: dict[Route, int] = defaultdict(int)
        self._in_flight_adapters: dict[str, int] = defaultdict(int)  # adapter name -> requests holding it
        self._evicted: dict[str, set[int]] = defaultdict(set)  # run -> serving versions unloaded for room
        self._used: dict[tuple[str, int], int] = {}  # (run, version) -> tick of its last checkout or load
        self._ticks = itertools.count(1)

    # what the controller changes -------------------------------------------
    def add_run(self, run: str) -> None:
        """Make a registered run routable (to version 0 until a version loads)."""
        if not RUN_NAME.fullmatch(run):
            raise ValueError(f"run name {run!r} is invalid")
        with self._lock:
            self._runs.add(run)

    def add_version(self, run: str, version: int, adapter: str | None = None, *, serve: bool = True) -> None:
        """Record a version the engine confirmed loaded under `adapter` (its first-attempt name
        when None); the run's alias moves to it if it is the newest, unless `serve` is False:
        then it is held (routable only as `run@vN`) until `serve` is called for it."""
        if version < 1:
            raise ValueError(f"version {version} of {run!r}: only versions >= 1 are adapters")
        with self._lock:
            if run not in self._runs:
                raise ValueError(f"unknown run {run!r}: add_run it (from the registry) before its versions")
            self._loaded[run][version] = adapter or adapter_name(run, version)
            self._evicted[run].discard(version)
            self._used[(run, version)] = next(self._ticks)
            if serve:
                self._alias[run] = max(self._alias.get(run, 0), version)

    def serve(self, run: str, version: int) -> None:
        """Move the run's alias to a held version (no older than what it serves)."""
        with self._lock:
            if version not in self._loaded.get(run, {}):
                raise ValueError(f"{run} v{version} is not loaded; it cannot serve")
            self._alias[run] = max(self._alias.get(run, 0), version)

    def held(self, run: str) -> list[int]:
        """Loaded versions newer than the one serving (waiting to serve), oldest first."""
        with self._lock:
            serving = self._serving(run)
            return sorted(v for v in self._loaded.get(run, ()) if v > serving)

    def retire(self, run: str, version: int) -> int:
        """Stop routing to a version (before unloading it); returns its in-flight count."""
        with self._lock:
            self._loaded[run].pop(version, None)
            self._evicted[run].discard(version)
            self._used.pop((run, version), None)
            return self._in_flight.get(Route(run, version), 0)

    def evict_idle(self, *, keep: frozenset[tuple[str, int]] = frozenset(),
                   run: str | None = None) -> tuple[str, int, str] | None:
        """Take the least recently used loaded version that no request holds (of `run` only, when
        given) out of the routable set, to unload it for room; returns (run, version, adapter name),
        or None when every such version is in flight, held (newer than its run serves) or in `keep`.

        A run's serving version stays what `<run>` means (loaded again on demand: `NotResident`).
        The check and the removal are one step under the lock, so a checkout either counted its
        request first (the version is not evicted) or finds it gone (and loads it again)."""
        with self._lock:
            return self._evict(keep, run, idle=True)

    def drain_lru(self, *, run: str | None = None) -> tuple[str, int, str] | None:
        """As `evict_idle`, but of the least recently used version even if requests hold it: they
        go on with its adapter, and new requests for it load it again on demand. For a load that
        waits while every slot serves requests (under steady load from more runs than slots, an
        adapter may never go idle on its own); the adapter is unloaded once
        `in_flight_adapter(name)` is 0."""
        with self._lock:
            return self._evict(frozenset(), run, idle=False)

    def _evict(self, keep: frozenset[tuple[str, int]], run: str | None, *, idle: bool) -> tuple[str, int, str] | None:
        candidates = [(self._used.get((r, v), 0), r, v)
                      for r, versions in self._loaded.items() if run is None or r == run for v in versions
                      if (r, v) not in keep and v <= self._serving(r)
                      and not (idle and self._in_flight_adapters.get(versions[v], 0))]
        if not candidates:
            return None
        _, victim, version = min(candidates)
        if version == self._serving(victim):
            self._evicted[victim].add(version)
        name = self._loaded[victim].pop(version)
        self._used.pop((victim, version), None)
        return victim, version, name

    def forget_evicted(self, run: str, below: int) -> None:
        """Forget the run's versions evicted for room that are older than `below` (outside its
        keep-window: no longer what `<run>` means). A request pinned to one loads it again on
        demand, as any version not loaded; without this, a run whose serving version is evicted
        at step after step would be remembered for every one of them."""
        with self._lock:
            evicted = self._evicted.get(run)
            if evicted:
                evicted.difference_update([v for v in evicted if v < below])

    def drop_run(self, run: str) -> dict[int, str]:
        """Forget a deleted run: it resolves no more. Returns its routable versions (version ->
        adapter name), to unload once the requests that hold them (still counted in flight) end."""
        with self._lock:
            self._runs.discard(run)
            self._alias.pop(run, None)
            self._evicted.pop(run, None)
            for key in [k for k in self._used if k[0] == run]:
                del self._used[key]
            return self._loaded.pop(run, {})

    # what anyone may read ---------------------------------------------------
    def runs(self) -> list[str]:
        with self._lock:
            return sorted(self._runs)

    def has_run(self, run: str) -> bool:
        with self._lock:
            return run in self._runs

    def loaded(self, run: str) -> list[int]:
        """Routable versions of a run, oldest first."""
        with self._lock:
            return sorted(self._loaded.get(run, ()))

    def evicted(self, run: str) -> list[int]:
        """Serving versions unloaded for room (loaded again when a request asks), oldest first."""
        with self._lock:
            return sorted(self._evicted.get(run, ()))

    def resident_count(self) -> int:
        """Versions loaded and routable, over all runs."""
        with self._lock:
            return sum(len(versions) for versions in self._loaded.values())

    def adapter(self, run: str, version: int) -> str | None:
        """Adapter name a routable version was loaded under; None if it is not routable."""
        with self._lock:
            return self._loaded.get(run, {}).get(version)

    def serving(self, run: str) -> int:
        """Version the run's alias points at (0 = base model)."""
        with self._lock:
            return self._serving(run)

    def _serving(self, run: str) -> int:
        """The newest loaded (or evicted for room) version the alias may point at (the next older
        one once it is retired)."""
        alias = self._alias.get(run, 0)
        known = [*self._loaded.get(run, ()), *self._evicted.get(run, ())]
        return max((v for v in known if v <= alias), default=0)

    def in_flight(self, run: str | None, version: int) -> int:
        with self._lock:
            return self._in_flight.get(Route(run, version), 0)

    def in_flight_adapter(self, name: str) -> int:
        """Requests holding the adapter loaded under `name` (a version loaded again after it was
        taken out of routing has another name, and its requests are not counted here)."""
        with self._lock:
            return self._in_flight_adapters.get(name, 0)

    def in_flight_total(self) -> int:
        with self._lock:
            return sum(self._in_flight.values())

    def known_models(self) -> list[str]:
        """Every model string that resolves now: base, runs, and `run@vN` of loaded versions."""
        with self._lock:
            out = [self.base_model]
            for run in sorted(self._runs):
                out.append(run)
                out.extend(f"{run}@v{v}" for v in sorted(self._loaded.get(run, ())))
            return out

    def snapshot(self) -> dict[str, Any]:
        """Runs with serving and loaded versions and in-flight counts, for status pages."""
        with self._lock:
            return {
                run: {
                    "serving_version": self._serving(run),
                    "loaded_versions": sorted(self._loaded.get(run, ())),
                    "evicted_versions": sorted(self._evicted.get(run, ())),
                    "adapters": {str(v): name for v, name in sorted(self._loaded.get(run, {}).items())},
                    "in_flight": {str(r.version): n for r, n in self._in_flight.items()
                                  if r.run == run and n},
                }
                for run in sorted(self._runs)
            }

    # resolution -------------------------------------------------------------
    def resolve(self, model: str) -> Route:
        """The route of a gateway `model` string; ModelNotFound lists what is known."""
        with self._lock:
            return self._resolve(model)

    def checkout(self, model: str) -> VersionHold:
        """Resolve and count one request in flight on the result, atomically."""
        with self._lock:
            route = self._resolve(model)
            self._in_flight[route] += 1
            if route.adapter is not None:
                self._in_flight_adapters[route.adapter] += 1
            if route.run is not None and route.version:
                self._used[(route.run, route.version)] = next(self._ticks)
        return VersionHold(self, route)

    def _resolve(self, model: str) -> Route:
        if model == self.base_model:
            return Route(None, 0)
        run, version = parse_model(model)
        if version is None and "@" in model and (pinned := named_run(model)) in self._runs:
            raise ModelNotFound(
                f"model {model!r}: {model[len(pinned) + 1:]!r} is no version of run {pinned!r}; pin one as "
                f"{pinned}@v7 or {pinned}@7 (ASCII digits, no leading zero), or ask for {pinned!r}, its newest",
                known=[self.base_model, *sorted(self._runs)],
            )
        if run not in self._runs:
            raise ModelNotFound(
                f"unknown model {model!r}: no run {run!r}; known: {self.base_model!r} (the base model) "
                f"and runs {sorted(self._runs)}",
                known=[self.base_model, *sorted(self._runs)],
            )
        loaded = self._loaded.get(run, {})
        if version is None:
            version = self._serving(run)
        if version == 0:
            return Route(run, 0)
        if version in loaded:
            return Route(run, version, loaded[version])
        versions = [f"{run}@v{v}" for v in sorted(loaded)]
        raise NotResident(
            f"version {version} of run {run!r} is not loaded; loaded: {versions or 'none'} "
            f"(plus {run}@v0, the base model)",
            run=run, version=version, known=[f"{run}@v0", *versions],
        )

    def _release(self, route: Route) -> None:
        with self._lock:
            _count_down(self._in_flight, route)
            if route.adapter is not None:
                _count_down(self._in_flight_adapters, route.adapter)


def _count_down(counts: dict[Any, int], key: Any) -> None:
    """One fewer in `counts[key]`; the key goes at 0."""
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
