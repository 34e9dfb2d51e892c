"""Versions across replicas: a replica serves a new version once every other ready replica holds it.

Each replica loads every version as it is announced, and then *holds* it: loaded, routable only
as `run@vN`, while the run's alias stays on the version before. It says so at once, in its
heartbeat (tandem.replicas) and with an `adapter_held` event, so the others need not wait for a
heartbeat to learn it. It moves the run's alias to the version, and appends `adapter_loaded`,
when every other live, ready replica holds that version (or serves it, or refused it with an
`adapter_rejected` naming itself), or when `replica.agree_s` has passed, whichever comes first;
then its `adapter_loaded` names the replicas it did not wait for (`without`). A client's `train()`
returns when every ready replica serves the version, those named in a `without` and silent since
aside (tandem.handles).

A replica left behind -- another ready replica serves a version this one does not hold, because
this one refused it or was too slow -- is out of rotation: its /ready answers 503 and its
heartbeat says it is not ready, so a router stops sending it requests and the others stop
waiting for it. It comes back once it holds and serves what the others serve. A replica that
cannot load a version, or lags, so never holds the run back for longer than `replica.agree_s`.

A replica alone serves each version as soon as it holds it.

Heartbeats are claims, not facts: another replica's `serving` counts only for a version the
registry has (registered after its files were written and checked). A claim of a version the
registry does not know -- forged, or from a replica of another deployment -- is ignored, logged
once and counted (`tandem_replica_claims_ignored`), so one bad heartbeat cannot take every
replica out of rotation.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from tandem.adapters import Manifest
from tandem.replicas import Replicas, ReplicaState
from tandem_inference.routing import RoutingTable

log = logging.getLogger(__name__)


@dataclass
class Held:
    """A version this replica loaded and waits to serve, with what its `adapter_loaded` will say."""

    run: str
    version: int
    manifest: Manifest
    adapter: str
    load_ms: float
    ready_ts: float | None
    stages_ms: dict[str, float] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)
    held_at: float = field(default_factory=time.time)
    """Wall-clock time the engine's load was confirmed (`adapter_held` says it)."""
    without: list[str] = field(default_factory=list)
    """The other ready replicas it serves without (they did not hold it within `replica.agree_s`);
    its `adapter_loaded` names them, so a client's `train()` does not wait for them either."""

    def ready_to_loaded_ms(self) -> float | None:
        """From the `adapter_ready` to now (the switch), the wait for the others included."""
        return (time.time() - self.ready_ts) * 1000.0 if self.ready_ts is not None else None


def holds(state: ReplicaState, run: str, version: int) -> bool:
    """Whether a replica's heartbeat says it holds (or already serves past) `version` of `run`."""
    run_state = state.runs.get(run)
    return run_state is not None and (version in run_state.loaded or run_state.serving >= version)


class Agreement:
    """This replica's held versions, when each may serve, and whether the replica is left behind."""

    def __init__(self, replicas: Replicas, replica_id: str, table: RoutingTable, agree_s: float, *,
                 registered: Callable[[str, int], bool], ignored: Counter | None = None) -> None:
        self.replicas = replicas
        self.registered = registered
        """Whether the registry has `version` of `run` (a claim of any other is ignored)."""
        self.ignored = ignored
        self._ignored_seen: set[tuple[str, str, int]] = set()
        self.replica_id = replica_id
        self.table = table
        self.agree_s = agree_s
        self.held: dict[tuple[str, int], Held] = {}
        self.refused: dict[tuple[str, int], set[str]] = defaultdict(set)
        """(run, version) -> the other replicas that refused it (they are not waited for)."""
        self.behind: dict[str, str] = {}
        """Run -> why this replica is out of rotation for it."""

    @property
    def in_rotation(self) -> bool:
        """False while another ready replica serves a version this one does not hold."""
        return not self.behind

    def hold(self, held: Held) -> None:
        self.held[(held.run, held.version)] = held

    def refused_by(self, run: str, version: int, replica: str) -> None:
        """Another replica refused `version`: it is not waited for."""
        if replica and replica != self.replica_id:
            self.refused[(run, version)].add(replica)

    def others(self) -> list[ReplicaState]:
        """The other live replicas that are ready (raises BackendUnavailable when Redis fails)."""
        return [s for s in self.replicas.live() if s.id != self.replica_id and s.ready]

    def due(self, others: list[ReplicaState]) -> list[Held]:
        """The newest held version of each run that may serve now; older held ones are dropped."""
        newest: dict[str, Held] = {}
        for (run, version), held in list(self.held.items()):
            if self.table.adapter(run, version) is None or version <= self.table.serving(run):
                del self.held[(run, version)]  # retired, lost with the engine, or overtaken
            elif run not in newest or version > newest[run].version:
                newest[run] = held
        due = []
        now = time.monotonic()
        for run, held in newest.items():
            waiting = [s.id for s in others
                       if not holds(s, run, held.version) and s.id not in self.refused[(run, held.version)]]
            if waiting and now - held.since < self.agree_s:
                continue
            if waiting:
                log.warning("%s v%d: replicas %s still do not hold it after %.1f s (replica.agree_s); serving "
                            "it without them, they leave rotation until they catch up",
                            run, held.version, waiting, now - held.since)
            held.without = waiting
            for key in [k for k in self.held if k[0] == run and k[1] <= held.version]:
                del self.held[key]
            for key in [k for k in self.refused if k[0] == run and k[1] <= held.version]:
                del self.refused[key]
            due.append(held)
        return due

    def check_behind(self, others: list[ReplicaState]) -> bool:
        """Recompute whether this replica is left behind; returns whether that changed. Reads the
        registry for the versions others claim to serve (call it off the event loop)."""
        behind: dict[str, str] = {}
        for run in self.table.runs():
            mine, loaded = self.table.serving(run), set(self.table.loaded(run))
            for state in others:
                run_state = state.runs.get(run)
                theirs = run_state.serving if run_state is not None else 0
                if theirs > mine and theirs not in loaded and self._believed(state.id, run, theirs):
                    behind[run] = f"replica {state.id} serves {run} v{theirs}, which this replica does not hold"
                    break
        changed = behind.keys() != self.behind.keys()
        if changed:
            if behind:
                log.warning("out of rotation: %s", "; ".join(behind.values()))
            else:
                log.info("back in rotation: serving what the other replicas serve")
        self.behind = behind
        return changed

    def _believed(self, replica: str, run: str, version: int) -> bool:
        """Whether another replica's claim to serve `version` of `run` names a registered version."""
        if self.registered(run, version):
            return True
        if (replica, run, version) not in self._ignored_seen:
            self._ignored_seen.add((replica, run, version))
            log.warning("replica %s claims to serve %s v%d, which the registry does not have: claim ignored",
                        replica, run, version)
            if self.ignored is not None:
                self.ignored.inc()
        return False
