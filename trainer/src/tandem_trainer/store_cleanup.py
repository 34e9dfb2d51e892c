"""What the trainer, the one writer of the adapter store, removes from it: the directories of
deleted runs, and the old versions the retention policy retires.

Deleted runs (tandem.deletion) are named in `tandem:runs:deleted`. The worker's liveness thread
looks there on every tick (2 s) and, when it names any, `StoreCleaner` removes them in a thread
of its own (one removal at a time: a large run takes a while, which liveness must not wait).
For each name whose run is not registered it takes the run's lock (no job of the run is between
its checks and its writes meanwhile), moves the run's directory aside
(`<root>/.tmp-deleted-<run>-<hex>`: one rename, so no reader sees half a run), removes it, and
takes the name out of the set, after which the name may be created again. Before that it tells the
worker's trainer (`JobContext.run_deleted`), whose next job first forgets what its backend holds
of the run in memory: resident weights, optimizer state, held gradients. A name whose run is
registered (an entry nobody deleted) is taken out, nothing removed.

Retention (`retention.keep_versions` K above 0): after each publish, under the run's lock, the
job removes the run's versions older than its newest K, except those a live inference replica
serves or holds (its heartbeat), those the registry records as serving or loaded, and the
`retention.pinned` ones; the newest version always stays. A retired version leaves the registry
first (no controller starts loading it after), then its directory is moved aside and removed
(a crash in between leaves a `.tmp-` directory, which the run's next publish removes). The job
that made it stays recorded, so that a late retry of that job is refused, not trained again.

Neither ever follows a symlink: a run or version directory that is one is left alone and logged.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

from tandem.adapters import AdapterStore
from tandem.errors import AdapterRejected, TandemError
from tandem.registry import Registry
from tandem.replicas import Replicas
from tandem.runs import RUN_NAME
from tandem.settings import RetentionSettings
from tandem_trainer.errors import LockTimeout
from tandem_trainer.metrics import TrainerMetrics
from tandem_trainer.run_lock import RunLock

log = logging.getLogger(__name__)

#: How long the cleaner holds a deleted run's lock at most, in milliseconds (a large run's removal).
CLEANUP_LOCK_MS = 600_000


def _discard(store: AdapterStore, path: Path, aside: str) -> bool:
    """Move `path` (a real directory in the store) aside as `aside` in its parent, then remove it;
    False when there is nothing to remove. Raises AdapterRejected for a symlink."""
    store.confined(path, f"{path.relative_to(store.root)}")
    if not path.exists():
        return False
    moved = path.with_name(f"{aside}-{uuid.uuid4().hex[:8]}")
    os.rename(path, moved)
    shutil.rmtree(moved)
    return True


# deleted runs ---------------------------------------------------------------------------------
def remove_deleted_runs(conn: redis.Redis, store: AdapterStore, owner: str, holder_alive: Callable[[str], bool],
                        metrics: TrainerMetrics | None = None,
                        on_removed: Callable[[str], None] | None = None) -> list[str]:
    """Remove the store directories of the runs named in `tandem:runs:deleted` (see the module
    docstring); returns the names taken out of it. A run whose lock a live job holds waits for the
    next call. `on_removed(run)` is told of each deleted run before its name is taken out (the
    trainer then forgets what it holds of it in memory before a run of that name can come again)."""
    registry = Registry(conn)
    done = []
    for run in registry.deleted_runs():
        if not RUN_NAME.fullmatch(run):
            log.warning("store.cleanup: %r in the deleted runs is no run name; taken out", run[:120])
            registry.forget_deleted(run)
            continue
        lock = RunLock(conn, run, owner, holder_alive)
        try:
            lock.acquire(ttl_ms=CLEANUP_LOCK_MS, wait_s=0)
        except LockTimeout:
            continue  # a job of it waits on the lock: it finds no run, and the next call removes it
        try:
            if registry.has_run(run):
                log.warning("store.cleanup: run %s is listed as deleted but is registered; nothing removed", run)
            else:
                _remove_run(store, run, metrics)
                if on_removed is not None:
                    on_removed(run)
            registry.forget_deleted(run)
            done.append(run)
        except (OSError, AdapterRejected) as exc:
            log.warning("store.cleanup: the directory of deleted run %s was not removed (%s); tried again", run, exc)
        finally:
            lock.release()
    return done


def _remove_run(store: AdapterStore, run: str, metrics: TrainerMetrics | None) -> None:
    t0 = time.perf_counter()
    for leftover in store.root.glob(f".tmp-deleted-{run}-*"):  # a removal a crash cut short
        shutil.rmtree(leftover, ignore_errors=True)
    removed = _discard(store, store.root / run, f".tmp-deleted-{run}")
    if removed and metrics is not None:
        metrics.store_removals.labels("run").inc()
    log.info("store.run_removed run=%s removed=%s duration_ms=%.1f", run, removed, (time.perf_counter() - t0) * 1000)


class StoreCleaner:
    """Removes deleted runs' directories (`remove_deleted_runs`) in a thread of its own, when poked."""

    def __init__(self, conn: redis.Redis, store: AdapterStore, holder_alive: Callable[[str], bool],
                 metrics: TrainerMetrics | None = None, on_removed: Callable[[str], None] | None = None) -> None:
        self.conn, self.store, self.holder_alive, self.metrics = conn, store, holder_alive, metrics
        self.on_removed = on_removed
        """Told of each deleted run as it is removed (the trainer's `run_deleted`)."""
        self._thread: threading.Thread | None = None

    def poke(self, owner: str) -> None:
        """When runs were deleted and no removal runs, start one, holding their locks as `owner` (the
        worker's liveness token). Cheap otherwise: one read of `tandem:runs:deleted`."""
        if (self._thread is not None and self._thread.is_alive()) or not Registry(self.conn).deleted_runs():
            return
        self._thread = threading.Thread(target=self._remove, args=(owner,), name="tandem-store-cleanup", daemon=True)
        self._thread.start()

    def _remove(self, owner: str) -> None:
        try:
            remove_deleted_runs(self.conn, self.store, owner, self.holder_alive, self.metrics, self.on_removed)
        except Exception:  # noqa: BLE001 - logged; the next poke tries again
            log.exception("store.cleanup failed; tried again at the next liveness tick")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Wait (up to `timeout_s`) for a removal under way to end."""
        if self._thread is not None:
            self._thread.join(timeout_s)


# retention ------------------------------------------------------------------------------------
def retire_old_versions(store: AdapterStore, registry: Registry, run: str, newest: int, policy: RetentionSettings,
                        metrics: TrainerMetrics | None = None) -> list[int]:
    """Apply the retention policy to `run` after `newest` was published (see the module docstring);
    returns the versions removed. Never raises: a failure is logged, and the next publish tries again."""
    if policy.keep_versions == 0:
        return []
    t0 = time.perf_counter()
    try:
        versions = sorted({m.version for m in registry.manifests(run)} | set(store.versions(run)))
        kept = set(versions[-policy.keep_versions:]) | {newest} | policy.pinned_of(run) | in_use(registry, run)
        retired = []
        for version in [v for v in versions if v < newest and v not in kept]:
            registry.retire_version(run, version)
            name = store.version_dir(run, version).name  # the path as named, not resolved: a symlink is refused
            _discard(store, store.root / run / name, f".tmp-retired-{name}")
            retired.append(version)
    except (OSError, TandemError) as exc:
        log.warning("retention of %s failed (%s); the next publish tries again", run, exc)
        return []
    if metrics is not None and retired:
        metrics.store_removals.labels("version").inc(len(retired))
    log.info("retention.end run=%s retired=%s kept=%d duration_ms=%.1f", run, retired, len(versions) - len(retired),
             (time.perf_counter() - t0) * 1000)
    return retired


def in_use(registry: Registry, run: str) -> set[int]:
    """Versions of `run` the inference side may serve from: what the registry records as serving and
    loaded, and what each live replica's heartbeat says it serves and holds."""
    used = {registry.serving(run), *registry.loaded(run)}
    for state in Replicas(registry.conn, prune=False).live():
        holding = state.runs.get(run)
        if holding is not None:
            used |= {holding.serving, *holding.loaded}
    return used
