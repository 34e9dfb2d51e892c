"""Jobs whose trainer died: liveness keys, and handing those jobs back to the queue.

rq notices a job whose worker died only when the job's StartedJobRegistry entry expires
(rq 3.0: the entry is `job_id:execution_id` scored now + job timeout + 60 s for a
SimpleWorker, cleaned by maintenance that runs every 10 minutes), and a job that a worker
took off the queue but never started (rq moves it to the queue's intermediate list,
`rq:queue:tandem-train:intermediate`, first) only after a minute on that list, found by the
same 10-minute maintenance. A trainer killed at the wrong moment would leave its job hanging
for up to half an hour. Each worker therefore keeps a liveness key with a short TTL,
refreshed by a daemon thread, and `recover_abandoned` runs at start-up and on every liveness
tick, so a live worker also rescues the jobs of a dead neighbour:

- a started job whose worker's key is gone is handed to rq's own cleanup at once, which
  requeues it (one of its retries) or fails it, exactly as rq would have done later; a failed
  one gets its `train_failed` event. A requeued job goes to the head of the queue
  (`Retry(enqueue_at_front=True)`), so the steps pipelined after the job a trainer died in still
  publish after it (when several trainers die at once, their jobs come back in any order). A job
  whose version is already published is requeued even with no retries left: its rerun returns
  that version, so rq never calls a job failed whose version serves;
- a job on the intermediate list that no worker started goes back to the front of the queue
  (no retry used): at once when no other trainer lives, else once it sat there `STRANDED_S`.

Every public function raises `BackendUnavailable`, naming the Redis URL, when Redis fails.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta

import redis
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import JobStatus
from rq.queue import Queue
from rq.utils import now

from tandem import keys
from tandem.connection import text, translated
from tandem.events import Event, EventKind, EventStream
from tandem.jobs import GuardedJob, train_queue
from tandem.registry import Registry

log = logging.getLogger(__name__)

#: A worker whose liveness key is older than this is dead; its jobs are requeued.
LIVENESS_TTL_S = 8.0
#: How often the liveness key is refreshed (and abandoned jobs looked for).
LIVENESS_INTERVAL_S = 2.0
#: A job taken off the queue but not started after this long was taken by a dead worker
#: (a live one starts it within milliseconds).
STRANDED_S = 5.0

liveness_key = keys.trainer_alive
RECOVERY_LOCK = keys.TRAINER_RECOVERY
#: How long the recovery lock lives when its holder never releases it.
RECOVERY_LOCK_MS = 30_000


class Liveness:
    """Keeps `liveness_key(name)` alive from a daemon thread; `token` identifies this process."""

    def __init__(
        self,
        conn: redis.Redis,
        worker_name: str,
        *,
        ttl_s: float = LIVENESS_TTL_S,
        interval_s: float = LIVENESS_INTERVAL_S,
        on_tick: Callable[[], object] | None = None,
    ) -> None:
        self.conn, self.name, self.ttl_ms, self.interval_s = conn, worker_name, int(ttl_s * 1000), interval_s
        self.token = f"{worker_name}#{uuid.uuid4().hex[:8]}"
        self.on_tick = on_tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        with translated(self.conn, f"refresh the liveness key of worker {self.name!r}"):
            self.conn.set(liveness_key(self.name), self.token, px=self.ttl_ms)

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="tandem-liveness", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                if self.on_tick is not None:
                    self.on_tick()
            except Exception:  # noqa: BLE001 - the thread must outlive a Redis hiccup
                log.exception("liveness tick of %s failed; retrying", self.name)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + 5)
        key = liveness_key(self.name)
        with translated(self.conn, f"delete the liveness key of worker {self.name!r}"):
            if (held := self.conn.get(key)) is not None and text(held) == self.token:
                self.conn.delete(key)


def owner_alive(conn: redis.Redis, owner: str) -> bool:
    """Whether the worker instance `owner` (a Liveness token) still lives."""
    with translated(conn, f"read the liveness key of {owner!r}"):
        raw = conn.get(liveness_key(owner.split("#", 1)[0]))
    return raw is not None and text(raw) == owner


def any_trainer_alive(conn: redis.Redis) -> bool:
    """Whether any trainer's liveness key exists."""
    with translated(conn, "look for live trainer workers"):
        return next(iter(conn.scan_iter(match=liveness_key("*"), count=100)), None) is not None


def failure_event(job: GuardedJob, message: str, *, retries_left: int) -> Event:
    """The `train_failed` event of a job that failed outside the train function."""
    return Event(kind=EventKind.TRAIN_FAILED, run=job.named_run(), job_id=job.id,
                 data={"message": message, "field": None, "retries_left": retries_left})


def recover_abandoned(
    conn: redis.Redis,
    *,
    holder: str | None = None,
    dead_names: frozenset[str] = frozenset(),
    alone: bool = False,
) -> list[str]:
    """Hand back the jobs of dead workers (see the module docstring); returns their ids.

    `holder` is the caller's Liveness token: the recovery lock carries it, so a worker that
    died while recovering does not keep the next one from recovering (its lock is taken over
    once its liveness key is gone). `dead_names` are worker names known dead whatever their
    liveness key says: at start-up, the worker's own name (a previous process of that name
    cannot still be running jobs). `alone` says no other trainer lives, so every job taken
    but not started is stranded.
    """
    token = holder or uuid.uuid4().hex
    with translated(conn, "hand back the jobs of dead trainer workers"):
        if not _take_lock(conn, token):
            return []  # another live worker is recovering right now
        try:
            queue = train_queue(conn)
            return _recover_started(conn, queue, dead_names) + _recover_taken(conn, queue, alone=alone)
        finally:
            _release_lock(conn, token)


def _take_lock(conn: redis.Redis, token: str) -> bool:
    """Take the recovery lock, or take it over from a holder whose liveness key is gone."""
    if conn.set(RECOVERY_LOCK, token, nx=True, px=RECOVERY_LOCK_MS):
        return True
    with conn.pipeline() as pipe:
        try:
            pipe.watch(RECOVERY_LOCK)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            held = pipe.get(RECOVERY_LOCK)
            if held is not None and ("#" not in (owner := text(held)) or owner_alive(conn, owner)):
                return False  # held by a live worker (or by a caller without a liveness key)
            pipe.multi()
            pipe.set(RECOVERY_LOCK, token, px=RECOVERY_LOCK_MS)
            pipe.execute()
        except redis.WatchError:
            return False  # another worker took it first
    if held is not None:
        log.warning("recovery.lock_taken_over from=%s: its holder died while recovering", text(held))
    return True


def _release_lock(conn: redis.Redis, token: str) -> None:
    with conn.pipeline() as pipe:
        try:
            pipe.watch(RECOVERY_LOCK)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            if (held := pipe.get(RECOVERY_LOCK)) is not None and text(held) == token:
                pipe.multi()
                pipe.delete(RECOVERY_LOCK)
                pipe.execute()
        except redis.WatchError:
            pass  # taken over meanwhile: it is no longer ours to delete


def _recover_started(conn: redis.Redis, queue: Queue, dead_names: frozenset[str]) -> list[str]:
    registry = queue.started_job_registry
    abandoned: list[GuardedJob] = []
    for job_id, execution_id in registry.get_job_and_execution_ids(cleanup=False):
        try:
            worker_name = Execution.fetch(execution_id, job_id, connection=conn).worker_name
        except ValueError:  # the execution record expired with its worker
            worker_name = ""
        if worker_name and worker_name not in dead_names and conn.exists(liveness_key(worker_name)):
            continue
        # Mark the entry expired and let rq's own cleanup requeue or fail it.
        conn.zadd(registry.key, {f"{job_id}:{execution_id}": 0}, xx=True)
        log.warning("job.abandoned job_id=%s worker=%s: requeueing", job_id, worker_name or "?")
        try:
            job = GuardedJob.fetch(job_id, connection=conn, serializer=queue.serializer)
        except NoSuchJobError:
            continue
        if isinstance(job, GuardedJob) and job.get_status() == JobStatus.STARTED:  # else a leftover entry
            abandoned.append(job)
            _keep_if_published(conn, job)
    if not abandoned:
        return []
    registry.cleanup(timestamp=1)
    for job in abandoned:
        if job.get_status() == JobStatus.FAILED:
            message = (f"job {job.id}: its trainer died on each of its attempts (killed or out of memory); "
                       "see the trainer's logs")
            log.warning("job.failed job_id=%s: %s", job.id, message)
            EventStream(conn).append(failure_event(job, message, retries_left=0))
    return [job.id for job in abandoned]


def _keep_if_published(conn: redis.Redis, job: GuardedJob) -> None:
    """Give a job whose version is published one more run, so it ends finished, not failed."""
    payload = job.payload()
    run = job.named_run()
    job_id = payload.get("job_id", job.id) if isinstance(payload, dict) else job.id
    if job.retries_left or not run or not isinstance(job_id, str):
        return
    version = Registry(conn).version_of_job(run, job_id)
    if version is not None:
        log.warning("job.published job_id=%s run=%s version=%d: requeued to finish with its version",
                    job.id, run, version)
        conn.hset(job.key, "retries_left", 1)


def _recover_taken(conn: redis.Redis, queue: Queue, *, alone: bool) -> list[str]:
    taken = queue.intermediate_queue
    started = {job_id for job_id, _ in queue.started_job_registry.get_job_and_execution_ids(cleanup=False)}
    stranded = []
    for job_id in taken.get_job_ids():
        if job_id in started:
            continue  # being started right now; rq takes it off the list itself
        if not alone:
            if taken.set_first_seen(job_id):
                continue
            first_seen = taken.get_first_seen(job_id)
            if first_seen is not None and now() - first_seen < timedelta(seconds=STRANDED_S):
                continue
        with conn.pipeline() as pipe:
            pipe.lrem(taken.key, 1, job_id)
            if conn.exists(GuardedJob.key_for(job_id)):
                queue.push_job_id(job_id, pipeline=pipe, at_front=True)
            pipe.delete(taken.get_first_seen_key(job_id))
            pipe.execute()
        stranded.append(job_id)
        log.warning("job.stranded job_id=%s: taken off the queue by a worker that never started it; requeued",
                    job_id)
    return stranded

