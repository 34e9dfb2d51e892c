"""What every kind of job runs against, and the parts of a job that every kind shares.

A `JobContext` holds the process's resident state (the backend with its model, the adapter
store, Redis: registry, events, publisher; the GPU lease in shared mode; the data-parallel
ranks; metrics; the experiment tracker) and the steps a job of any kind takes on it: find its
run, hold the run's lock (run_lock.py) and the GPU, and keep the other ranks told of what the
backend holds. The frame around each job (runner.py) and the kinds (kinds.py) use it; a kind
never builds any of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
from pydantic import JsonValue

from tandem.adapters import AdapterStore
from tandem.errors import RunNotFound
from tandem.events import EventStream
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.settings import TrainerSettings
from tandem_trainer import failpoints
from tandem_trainer.backends.base import Backend
from tandem_trainer.errors import JobRejected, RanksLost
from tandem_trainer.gpu_sharing import SharedGpu
from tandem_trainer.metrics import TrainerMetrics
from tandem_trainer.parallel import Group
from tandem_trainer.publisher import Publisher
from tandem_trainer.run_lock import RunLock
from tandem_trainer.tracking import Tracker

log = logging.getLogger(__name__)


class JobContext:
    """One backend (the resident model), store and Redis, and what jobs of every kind do with them."""

    def __init__(
        self,
        settings: TrainerSettings,
        conn: redis.Redis,
        backend: Backend,
        store: AdapterStore | None = None,
        *,
        owner: str = "trainer",
        holder_alive: Callable[[str], bool] = lambda owner: True,
        entropy: bool = True,
        gpu: SharedGpu | None = None,
        group: Group | None = None,
        metrics: TrainerMetrics | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        self.settings, self.conn, self.backend = settings, conn, backend
        self.gpu = gpu
        """Shared mode: the GPU lease held around each job's compute (None in split/cpu mode)."""
        self.group = group
        """Data-parallel training: this process is rank 0 of these ranks (step.py)."""
        self.store = store or AdapterStore(settings.store.root)
        self.registry, self.events = Registry(conn), EventStream(conn)
        self.publisher = Publisher(conn, self.store, blanks=settings.backend.blank_adapter_file)
        self.owner, self.holder_alive, self.entropy = owner, holder_alive, entropy
        self.metrics = metrics or TrainerMetrics()
        """Prometheus metrics of the jobs (metrics.py); the worker serves them on /metrics."""
        self.metrics.watch_resident(backend.resident_stats)
        self.tracker = tracker
        """The experiment tracker each published step is logged to (tracking.py), if any."""
        self._deleted: set[str] = set()
        self._deleted_lock = threading.Lock()

    def run_spec(self, name: str) -> RunSpec:
        """The spec of the run a job names; a run that does not exist rejects the job."""
        try:
            return self.registry.get_run(name)
        except RunNotFound as exc:
            raise JobRejected(f"run: {exc}; create the run before training it", field="run") from exc

    @contextmanager
    def locked(self, run: str, timeout_s: int) -> Iterator[None]:
        """Hold `run`'s lock for the block: no other worker works on the run meanwhile. The lock
        lives as long as the job may (`timeout_s`), and is waited for as long.

        The run is looked up again once the lock is held: a run deleted while the job waited for
        the lock (tandem.deletion refuses while the lock is held) rejects the job, which so never
        writes a version of a run that is gone."""
        lock = RunLock(self.conn, run, self.owner, self.holder_alive)
        lock.acquire(ttl_ms=timeout_s * 1000, wait_s=timeout_s)
        failpoints.hit("lock_taken")
        try:
            if not self.registry.has_run(run):
                raise JobRejected(f"run: run {run!r} was deleted while the job waited for it", field="run")
            yield
        finally:
            lock.release()

    @contextmanager
    def device(self) -> Iterator[float | None]:
        """Hold what the block's compute needs: in shared mode the GPU lease, yielding the seconds
        waited for it; otherwise nothing, yielding None."""
        if self.gpu is None:
            yield None
            return
        with self.gpu.held() as waited:
            yield waited

    # deleted runs ---------------------------------------------------------------
    def run_deleted(self, run: str) -> None:
        """Note, from any thread (the store cleaner's), that `run` was deleted: the next job forgets
        what the backend holds of it before it starts (`forget_deleted`), so no later run of the name
        ever meets its state; only the job thread touches the backend."""
        with self._deleted_lock:
            self._deleted.add(run)

    def forget_deleted(self) -> list[str]:
        """Forget, on every rank, what the backend holds of the runs deleted since the last call
        (resident weights, optimizer state, held gradients); returns the runs it held something of."""
        with self._deleted_lock:
            runs, self._deleted = sorted(self._deleted), set()
        forgot = []
        for run in runs:
            if self.backend.forget_run(run):
                forgot.append(run)
            self.tell("forget_run", run=run)
        if forgot:
            log.info("trainer.forget runs=%s (deleted)", forgot)
        return forgot

    # the other ranks ------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget the version in memory, on every rank."""
        self.backend.invalidate()
        self.tell("invalidate")

    def tell(self, kind: str, **body: JsonValue) -> None:
        """Tell the other ranks how the job ended; when they are gone, they restart anyway and
        the job's outcome stands (the worker then stops, see worker.py)."""
        if self.group is None or self.group.broken:
            return
        try:
            self.group.send(kind, **body)
        except RanksLost as exc:
            log.warning("the other ranks are gone (%s); the worker stops after this job", exc)
