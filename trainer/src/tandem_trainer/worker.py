"""The rq side of the trainer: the worker class, the job function, and serving the queue.

The worker is an rq `SimpleWorker`: jobs run in the worker process itself (it never forks,
so CUDA is safe) and one process-global Trainer keeps the base model resident across jobs.
It runs only tandem's job functions (the train function and Tinker's three, `JOB_FUNCS`): the
queue's job class (`tandem.jobs.GuardedJob`) refuses any other function, callback or webhook,
and any job hash rq cannot read. Every job
that fails gets a `train_failed` event naming it, from the train function when the failure
is its own, else from the worker; a refused job is never retried. Its Redis connections ride
out an outage of up to `redis_outage_s` (outage.py); recovery.py hands back the jobs of dead
workers, and a thread removes deleted runs' directories from the store (store_cleanup.py).
Each job function names its kind of job (`tandem_trainer.jobs.kinds`: `train`, and Tinker's
`forward_backward`, `optim_step`, `load_state`), and the job's payload, the JSON form of that
kind's model (a `TrainJob`, or one of `tandem.tinker_jobs`), goes to `Trainer.run` as rq decoded
it, to be validated there once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import JsonValue
from rq import SimpleWorker, get_current_job
from rq.executions import Execution
from rq.job import Job
from rq.job_lifecycle import call_exception_handlers, format_exc_info
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException

from tandem.adapters import AdapterStore
from tandem.connection import translated
from tandem.errors import TandemError
from tandem.events import EventStream
from tandem.fair_queue import FairQueue
from tandem.jobs import STARTED, GuardedJob, claim, train_queue
from tandem.settings import TrainerSettings
from tandem_trainer import failpoints
from tandem_trainer.backends.select import select_backend
from tandem_trainer.errors import TrainerConfigError
from tandem_trainer.gpu_sharing import SharedGpu
from tandem_trainer.jobs.failures import not_retried
from tandem_trainer.jobs.kinds import FORWARD_BACKWARD, LOAD_STATE, OPTIM_STEP, TRAIN
from tandem_trainer.jobs.runner import Trainer
from tandem_trainer.metrics import TrainerMetrics, serve_metrics
from tandem_trainer.outage import ride_out_outages
from tandem_trainer.parallel import Group
from tandem_trainer.recovery import (
    LIVENESS_TTL_S,
    Liveness,
    any_trainer_alive,
    failure_event,
    liveness_key,
    owner_alive,
    recover_abandoned,
)
from tandem_trainer.store_cleanup import StoreCleaner
from tandem_trainer.trackers import open_tracker

log = logging.getLogger(__name__)

#: The longest one wait for the next job lasts (rq's BLPOP; rq's default is 405 s). A SIGTERM that
#: the kernel hands to another of the worker's threads (it does when the main thread has a signal
#: pending already) is acted on only when the main thread next runs Python: at the latest when this
#: wait ends, well inside `docker stop`'s 10 s.
JOB_WAIT_S = 5

#: Timeout of the Redis command a /metrics scrape makes (the queue's depth), below Prometheus'
#: default scrape timeout of 10 s.
SCRAPE_REDIS_TIMEOUT_S = 2.0


class TrainWorker(SimpleWorker):
    """rq's SimpleWorker on `GuardedJob`s: refused jobs fail at once, every failure is announced."""

    job_class = GuardedJob
    queue_class = FairQueue  # jobs in fair turns across runs
    group: Group | None = None
    """Data-parallel training: the ranks this worker is rank 0 of."""

    @property
    def dequeue_timeout(self) -> int:
        """rq's wait for the next job, at a time (JOB_WAIT_S). rq also raises the connection's
        socket timeout to this plus 10 s where that is longer: at 5 s it never is, so the
        trainer's connection keeps its own (`redis.socket_timeout_s`)."""
        return JOB_WAIT_S

    def execute_job(self, job: Job, queue: Queue) -> None:
        failpoints.hit("after_dequeue")
        if claim(self.connection, job.key, STARTED) != STARTED:
            # its client gave up on it while it waited and told its caller it would never run
            log.info("job.skipped job_id=%s: its client cancelled it before it started", job.id)
            with translated(self.connection, f"take cancelled job {job.id} off the intermediate queue"):
                self.connection.lrem(queue.intermediate_queue_key, 1, job.id)
            return
        super().execute_job(job, queue)
        if self.group is not None and self.group.broken:
            log.error("worker.stop: the trainer's ranks lost each other during job %s; the worker stops "
                      "so that torchrun starts every rank again", job.id)
            self._stop_requested = True

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        """rq logs every failure with its traceback. A failure tandem explains (a TandemError: a bad
        job, a missing checkpoint, out of memory) has had its `train.failed` line, naming the job, the
        field and the message; its traceback is logged at DEBUG (TANDEM_LOG_LEVEL=DEBUG shows it).
        An unexpected exception keeps rq's traceback."""
        if len(exc_info) > 1 and isinstance(exc_info[1], TandemError):
            log.debug("job %s: the traceback of its failure\n%s", job.id, format_exc_info(exc_info))
            call_exception_handlers(self._exc_handlers, job, *exc_info)
            return
        super().handle_exception(job, *exc_info)

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry,
                           execution: Execution) -> None:
        failpoints.hit("before_finish")
        super().handle_job_success(job, queue, started_job_registry, execution)
        _count("finished")

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry | None = None,
                           exc_string: str = "", execution: Execution | None = None) -> None:
        if isinstance(job, GuardedJob):
            refusal = job.refusal()
            if refusal is not None:
                log.warning("job.refused job_id=%s reason=%s", job.id, refusal)
                job.retries_left = 0  # refused the same way every time
            if not job.failure_reported:
                lines = [line for line in exc_string.strip().splitlines() if line.strip()]
                message = refusal or (lines[-1] if lines else "the job failed without an error message")
                retries_left = job.retries_left if job.retries_left and job.retries_left > 0 else 0
                EventStream(self.connection).append(failure_event(job, message, retries_left=retries_left))
        _count("retried" if job.retries_left and job.retries_left > 0 else "failed")
        super().handle_job_failure(job, queue, started_job_registry, exc_string, execution)


# the process-global trainer -----------------------------------------------------
@dataclass
class _Context:
    trainer: Trainer
    liveness: Liveness


_context: _Context | None = None


def _count(outcome: str) -> None:
    """Count a job's outcome in the process's metrics (none before the trainer is set up)."""
    if _context is not None:
        _context.trainer.metrics.jobs.labels(outcome).inc()


def setup(settings: TrainerSettings, conn: redis.Redis, liveness: Liveness, group: Group | None = None) -> Trainer:
    """Create the process's Trainer (and its backend, which keeps the model) once."""
    global _context
    if _context is None:
        index = group.device_index if group is not None else None
        metrics = TrainerMetrics()
        backend = select_backend(settings.backend, device_index=index, shared_gpu=settings.gpus.lends_memory)
        trainer = Trainer(
            settings, conn, backend, AdapterStore(settings.store.root),
            owner=liveness.token, holder_alive=lambda owner: owner_alive(conn, owner),
            gpu=SharedGpu(conn, settings.gpus, holder=liveness.token) if settings.gpus.leased else None,
            group=group, metrics=metrics, tracker=open_tracker(settings.tracker, metrics),
        )
        _context = _Context(trainer=trainer, liveness=liveness)
    return _context.trainer


def _trainer() -> Trainer:
    """The global Trainer; built from the environment when rq was started without main()."""
    if _context is not None:
        return _context.trainer
    settings = TrainerSettings()
    conn = ride_out_outages(settings.redis.connect(), settings.redis_outage_s)
    job = get_current_job()
    liveness = Liveness(ride_out_outages(settings.redis.connect(), settings.redis_outage_s),
                        job.worker_name if job and job.worker_name else "rq", ttl_s=settings.liveness_ttl_s,
                        interval_s=settings.liveness_ttl_s / 4)
    liveness.start()
    return setup(settings, conn, liveness)


def run_train_job(payload: JsonValue) -> dict[str, JsonValue]:
    """rq job function (`tandem.jobs.TRAIN_FUNC`): train one job, return its TrainResult as JSON."""
    return _run_job(TRAIN.name, payload)


def run_forward_backward_job(payload: JsonValue) -> dict[str, JsonValue]:
    """rq job function (`tandem.tinker_jobs.FORWARD_BACKWARD_FUNC`): a ForwardBackwardResult as JSON."""
    return _run_job(FORWARD_BACKWARD.name, payload)


def run_optim_step_job(payload: JsonValue) -> dict[str, JsonValue]:
    """rq job function (`tandem.tinker_jobs.OPTIM_STEP_FUNC`): an OptimStepResult as JSON."""
    return _run_job(OPTIM_STEP.name, payload)


def run_load_state_job(payload: JsonValue) -> dict[str, JsonValue]:
    """rq job function (`tandem.tinker_jobs.LOAD_STATE_FUNC`): a LoadStateResult as JSON."""
    return _run_job(LOAD_STATE.name, payload)


def _run_job(kind: str, payload: JsonValue) -> dict[str, JsonValue]:
    """Run one job of the kind named `kind` (tandem_trainer.jobs.kinds); return its result as JSON."""
    failpoints.hit("job_started")
    job = get_current_job()
    if job is not None and isinstance(payload, dict) and "job_id" not in payload:
        payload = {**payload, "job_id": job.id}  # a retry must find what its first attempt did
    trainer = _trainer()
    try:
        retries_left = (job.retries_left or 0) if job is not None else 0
        result = trainer.run(kind, payload, retries_left=retries_left, job_id=job.id if job else None)
    except Exception as exc:
        if isinstance(job, GuardedJob):
            job.failure_reported = True  # the job's frame appended the failure's event
        if isinstance(exc.__cause__, JobTimeoutException):  # what the trainer made of rq's timeout
            log.warning("job.timed_out job_id=%s timeout_s=%s: not retried (raise the job's timeout_s)",
                        job.id if job else None, job.timeout if job else None)
        if not_retried(exc) and job is not None:
            # Bad input fails the same way every time, and a job out of its time would run out of
            # it again: no retries. The worker's failure handling reads the in-memory job (the
            # same object in a SimpleWorker), and the stored hash is updated too for anyone who
            # fetches the job.
            job.retries_left = 0
            with translated(job.connection, f"mark job {job.id} as not to be retried"):
                job.connection.hset(job.key, "retries_left", 0)
        raise
    failpoints.hit("after_state")
    return result.model_dump(mode="json")


# serving ------------------------------------------------------------------------
def claim_name(conn: redis.Redis, name: str, ttl_s: float = LIVENESS_TTL_S) -> None:
    """Wait until no live process holds `name` (a predecessor's key runs out within `ttl_s`)."""
    deadline = time.monotonic() + ttl_s * 1.5
    with translated(conn, f"claim the worker name {name!r}"):
        while conn.exists(liveness_key(name)):
            if time.monotonic() > deadline:
                raise TrainerConfigError(
                    f"a trainer worker named {name!r} is alive; give each worker its own TANDEM_WORKER_NAME"
                )
            time.sleep(0.2)
        stale = TrainWorker.find_by_key(
            TrainWorker.redis_worker_namespace_prefix + name, connection=conn, serializer=JSONSerializer
        )
        if stale is not None and stale.death_date is None:
            # rq refuses to start a worker whose name looks alive; rq 3.0 leaves this untyped
            stale.register_death()  # type: ignore[no-untyped-call]


def serve(settings: TrainerSettings, conn: redis.Redis, name: str, *, burst: bool = False,
          group: Group | None = None) -> bool:
    """Recover abandoned jobs, then work the train queue until a (warm) shutdown; with `group`,
    as rank 0 of data-parallel ranks, which are told to stop when the worker does."""
    ride_out_outages(conn, settings.redis_outage_s)
    claim_name(conn, name, settings.liveness_ttl_s)
    started = time.perf_counter()
    alone = not any_trainer_alive(conn)
    thread_conn = ride_out_outages(settings.redis.connect(), settings.redis_outage_s)
    cleaner = StoreCleaner(thread_conn, AdapterStore(settings.store.root), lambda owner: owner_alive(thread_conn, owner))

    def tick() -> None:
        recover_abandoned(thread_conn, holder=liveness.token)
        cleaner.poke(liveness.token)

    liveness = Liveness(thread_conn, name, ttl_s=settings.liveness_ttl_s, interval_s=settings.liveness_ttl_s / 4,
                        on_tick=tick)
    liveness.beat()  # the recovery lock names this process; others see it is alive
    recovered = recover_abandoned(conn, holder=liveness.token, dead_names=frozenset({name}), alone=alone)
    log.info("recovery.end requeued=%d duration_s=%.3f jobs=%s",
             len(recovered), time.perf_counter() - started, recovered)
    liveness.start()
    metrics_server = None
    # a scrape reads the queue on a connection of its own that neither rides out an outage nor waits
    # longer than Prometheus' scrape timeout (10 s): a hung Redis reads NaN, the trainer stays up
    scrape_conn = settings.redis.connect(ping=False, timeout_s=SCRAPE_REDIS_TIMEOUT_S)
    try:
        trainer = setup(settings, conn, liveness, group)
        cleaner.metrics, cleaner.on_removed = trainer.metrics, trainer.run_deleted
        scrape_queue = train_queue(scrape_conn)
        trainer.metrics.watch_queue(lambda: scrape_queue.count)
        metrics_server = serve_metrics(trainer.metrics, settings.metrics)
        worker = TrainWorker([train_queue(conn)], connection=conn, name=name, serializer=JSONSerializer)
        worker.group = group
        return worker.work(burst=burst, with_scheduler=False)
    finally:
        liveness.stop()
        cleaner.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
        scrape_conn.close()
        if _context is not None and _context.trainer.tracker is not None:
            _context.trainer.tracker.close()
        if group is not None:
            group.stop()
