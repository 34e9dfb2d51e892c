"""The rq side of the trainer: the job function, worker liveness and abandoned-job recovery.

The worker is an rq `SimpleWorker`: jobs run in the worker process itself (it never forks,
so CUDA is safe) and one process-global Trainer keeps the base model resident across jobs.

rq notices a job whose worker died only when the job's StartedJobRegistry entry expires
(rq 3.0: the entry is `job_id:execution_id` scored now + job timeout + 60 s for a
SimpleWorker, cleaned by maintenance that runs every 10 minutes), so a trainer killed
mid-job would leave its job hanging for up to half an hour. Each worker therefore keeps a
liveness key with a short TTL, refreshed by a daemon thread; any entry of the train queue
whose worker's key is gone is handed to rq's own cleanup at once, which requeues it (one of
its retries) or fails it, exactly as rq would have done later. Recovery runs at start-up and
then on every liveness tick, so a live worker also rescues the jobs of a dead neighbour.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from rq import SimpleWorker, get_current_job
from rq.executions import Execution
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from tandem import keys
from tandem.adapters import AdapterStore
from tandem.errors import ConfigError
from tandem.jobs import train_queue
from tandem.settings import TrainerSettings
from tandem_trainer.backend import select_backend
from tandem_trainer.errors import JobRejected
from tandem_trainer.sharing import SharedGpu
from tandem_trainer.trainer import Trainer

log = logging.getLogger(__name__)

#: A worker whose liveness key is older than this is dead; its jobs are requeued.
LIVENESS_TTL_S = 8.0
#: How often the liveness key is refreshed (and abandoned jobs looked for).
LIVENESS_INTERVAL_S = 2.0


liveness_key = keys.trainer_alive
RECOVERY_LOCK = keys.TRAINER_RECOVERY


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
        if self.conn.get(key) == self.token.encode():
            self.conn.delete(key)


def owner_alive(conn: redis.Redis, owner: str) -> bool:
    """Whether the worker instance `owner` (a Liveness token) still lives."""
    raw = conn.get(liveness_key(owner.split("#", 1)[0]))
    return raw is not None and (raw.decode() if isinstance(raw, bytes) else raw) == owner


def recover_abandoned(conn: redis.Redis, *, dead_names: frozenset[str] = frozenset()) -> list[str]:
    """Requeue (or fail, when out of retries) started jobs whose worker is gone; returns their ids.

    `dead_names` are worker names known dead whatever their liveness key says: at start-up,
    the worker's own name (a previous process of that name cannot still be running jobs).
    """
    if not conn.set(RECOVERY_LOCK, uuid.uuid4().hex, nx=True, px=30_000):
        return []  # another worker is recovering right now
    try:
        registry = StartedJobRegistry(keys.TRAIN_QUEUE, connection=conn, serializer=JSONSerializer)
        abandoned = []
        for job_id, execution_id in registry.get_job_and_execution_ids(cleanup=False):
            try:
                worker_name = Execution.fetch(execution_id, job_id, connection=conn).worker_name
            except ValueError:  # the execution record expired with its worker
                worker_name = ""
            if worker_name and worker_name not in dead_names and conn.exists(liveness_key(worker_name)):
                continue
            # Mark the entry expired and let rq's own cleanup requeue or fail it.
            conn.zadd(registry.key, {f"{job_id}:{execution_id}": 0}, xx=True)
            abandoned.append(job_id)
            log.warning("job.abandoned job_id=%s worker=%s: requeueing", job_id, worker_name or "?")
        if abandoned:
            registry.cleanup(timestamp=1)
        return abandoned
    finally:
        conn.delete(RECOVERY_LOCK)


# the process-global trainer -----------------------------------------------------
@dataclass
class _Context:
    trainer: Trainer
    liveness: Liveness


_context: _Context | None = None


def setup(settings: TrainerSettings, conn: redis.Redis, liveness: Liveness) -> Trainer:
    """Create the process's Trainer (and its backend, which keeps the model) once."""
    global _context
    if _context is None:
        trainer = Trainer(
            settings, conn, select_backend(settings), AdapterStore(settings.store.root),
            owner=liveness.token, holder_alive=lambda owner: owner_alive(conn, owner),
            gpu=SharedGpu(conn, settings.gpus, holder=liveness.token) if settings.gpus.mode == "shared" else None,
        )
        _context = _Context(trainer=trainer, liveness=liveness)
    return _context.trainer


def _trainer() -> Trainer:
    """The global Trainer; built from the environment when rq was started without main()."""
    if _context is not None:
        return _context.trainer
    settings = TrainerSettings()
    conn = settings.redis.connect()
    job = get_current_job()
    liveness = Liveness(settings.redis.connect(), job.worker_name if job and job.worker_name else "rq")
    liveness.start()
    return setup(settings, conn, liveness)


def run_train_job(payload: dict[str, Any]) -> dict[str, Any]:
    """rq job function (`tandem.jobs.TRAIN_FUNC`): train one job, return its TrainResult as JSON."""
    job = get_current_job()
    if job is not None and isinstance(payload, dict) and "job_id" not in payload:
        payload = {**payload, "job_id": job.id}  # a retry must find what its first attempt did
    try:
        retries_left = (job.retries_left or 0) if job is not None else 0
        return _trainer().train(payload, retries_left=retries_left).model_dump(mode="json")
    except JobRejected:
        if job is not None:
            # Bad input fails the same way every time: no retries. The worker's failure
            # handling reads the in-memory job (the same object in a SimpleWorker), and the
            # stored hash is updated too for anyone who fetches the job.
            job.retries_left = 0
            job.connection.hset(job.key, "retries_left", 0)
        raise


# serving ------------------------------------------------------------------------
def claim_name(conn: redis.Redis, name: str) -> None:
    """Wait until no live process holds `name` (a predecessor's key runs out within the TTL)."""
    deadline = time.monotonic() + LIVENESS_TTL_S + 2 * LIVENESS_INTERVAL_S
    while conn.exists(liveness_key(name)):
        if time.monotonic() > deadline:
            raise ConfigError(
                f"a trainer worker named {name!r} is alive; give each worker its own TANDEM_WORKER_NAME"
            )
        time.sleep(0.2)
    stale = SimpleWorker.find_by_key(
        SimpleWorker.redis_worker_namespace_prefix + name, connection=conn, serializer=JSONSerializer
    )
    if stale is not None and stale.death_date is None:
        stale.register_death()  # rq refuses to start a worker whose name looks alive


def serve(settings: TrainerSettings, conn: redis.Redis, name: str, *, burst: bool = False) -> bool:
    """Recover abandoned jobs, then work the train queue until a (warm) shutdown."""
    claim_name(conn, name)
    started = time.perf_counter()
    recovered = recover_abandoned(conn, dead_names=frozenset({name}))
    log.info("recovery.end requeued=%d duration_s=%.3f jobs=%s",
             len(recovered), time.perf_counter() - started, recovered)
    thread_conn = settings.redis.connect()
    liveness = Liveness(thread_conn, name, on_tick=lambda: recover_abandoned(thread_conn))
    liveness.start()
    try:
        setup(settings, conn, liveness)
        worker = SimpleWorker([train_queue(conn)], connection=conn, name=name, serializer=JSONSerializer)
        return worker.work(burst=burst, with_scheduler=False)
    finally:
        liveness.stop()
