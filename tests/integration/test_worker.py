"""The real worker process (`python -m tandem_trainer.main`) on a real Redis and the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.jobs import RUN, make_job, status
from helpers.workers import wait_for
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem.adapters import AdapterStore
from tandem.events import EventKind, EventStream
from tandem.jobs import CANCELLED, STARTED, TrainResult, claim, enqueue, train_queue
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, RunSpec
from tandem_trainer.worker import JOB_WAIT_S

pytestmark = pytest.mark.integration

#: An idle worker's warm shutdown after its wait for a job ends, with room for a loaded machine.
WARM_SHUTDOWN_S = 7


def test_bad_job_fails_once_and_the_worker_serves_the_next(workers, redis_conn, tiny_model: Path,
                                                           tmp_path: Path) -> None:
    Registry(redis_conn).create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4)))
    bad = make_job("bad-job")
    bad.groups[0].trajectories[0].completion_ids[2] = 4096  # outside the tiny vocab of 512
    enqueue(redis_conn, bad)
    enqueue(redis_conn, make_job("good-job", seed=1))
    worker = workers()

    wait_for(lambda: status(redis_conn, "good-job") == JobStatus.FINISHED, 90, "the good job", worker)
    failed = Job.fetch("bad-job", connection=redis_conn, serializer=JSONSerializer)
    assert failed.get_status() == JobStatus.FAILED  # FAILED, not requeued for a retry
    assert failed.retries_left == 0
    result = failed.latest_result()
    assert result is not None and "groups.0.trajectories.0.completion_ids" in (result.exc_string or "")
    assert "4096" in (result.exc_string or "")
    train_failed = [e for e in EventStream(redis_conn).history() if e.kind is EventKind.TRAIN_FAILED]
    assert [(e.job_id, e.data["field"]) for e in train_failed] == [
        ("bad-job", "groups.0.trajectories.0.completion_ids")
    ]  # one attempt only
    logged = worker.log()
    assert [line for line in logged.splitlines() if "train.failed" in line and "job_id=bad-job" in line
            and "field=groups.0.trajectories.0.completion_ids" in line], logged[-3000:]
    assert "Traceback" not in logged, logged[-3000:]  # an explained failure is its line, not rq's traceback

    good = TrainResult.model_validate(Job.fetch("good-job", connection=redis_conn,
                                                serializer=JSONSerializer).return_value())
    assert (good.version, good.parent, good.reused) == (1, 0, False)
    assert Registry(redis_conn).latest_version(RUN) == 1
    AdapterStore(tmp_path / "adapters").verify(RUN, 1)

    assert worker.stop() == 0  # SIGTERM: warm shutdown, clean exit


def test_a_job_its_client_cancelled_after_the_worker_took_it_never_runs(workers, redis_conn, tiny_model: Path) -> None:
    """The client's give-up (TrainTimeout: "not started and is cancelled") and the worker taking the
    job off the queue can cross; whichever claims the job first decides, and the client says which."""
    Registry(redis_conn).create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4)))
    enqueue(redis_conn, make_job("given-up"))
    key = Job.fetch("given-up", connection=redis_conn, serializer=JSONSerializer).key
    assert claim(redis_conn, key, CANCELLED) == CANCELLED  # as the client's give-up claims it
    enqueue(redis_conn, make_job("next-job", seed=1))
    worker = workers()

    wait_for(lambda: status(redis_conn, "next-job") == JobStatus.FINISHED, 90, "the next job", worker)
    assert status(redis_conn, "given-up") != JobStatus.FINISHED
    assert Registry(redis_conn).latest_version(RUN) == 1  # the next job's version alone
    ready = [e.job_id for e in EventStream(redis_conn).history() if e.kind is EventKind.ADAPTER_READY]
    assert ready == ["next-job"]
    assert not redis_conn.lrange(train_queue(redis_conn).intermediate_queue_key, 0, -1)
    assert "job.skipped job_id=given-up" in worker.log()
    assert claim(redis_conn, key, STARTED) == CANCELLED  # a later claim learns the first one's fate
    assert worker.stop() == 0


def test_killed_worker_job_completes_once_on_a_new_worker(workers, redis_conn, tiny_model: Path,
                                                          tmp_path: Path) -> None:
    # Six passes over 32 sequences of 300 tokens: a few seconds of work on the tiny model.
    spec = RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4), loss=LossConfig(epochs=6))
    Registry(redis_conn).create_run(spec)
    job = make_job("big-job", groups=4, size=8, prompt=100, completion=200)
    enqueue(redis_conn, job)
    first = workers()
    wait_for(lambda: status(redis_conn, "big-job") == JobStatus.STARTED, 90, "the job to start", first)
    wait_for(lambda: "adapter.activate" in first.log(), 30, "training to begin", first)
    time.sleep(0.3)
    first.proc.kill()  # SIGKILL: no cleanup, the job is left STARTED with the run lock held
    first.proc.wait(10)
    assert status(redis_conn, "big-job") == JobStatus.STARTED
    registry, store = Registry(redis_conn), AdapterStore(tmp_path / "adapters")
    assert registry.latest_version(RUN) == 0

    second = workers()
    wait_for(lambda: status(redis_conn, "big-job") == JobStatus.FINISHED, 120, "the job to finish", second)
    result = TrainResult.model_validate(Job.fetch("big-job", connection=redis_conn,
                                                  serializer=JSONSerializer).return_value())
    assert (result.version, result.parent) == (1, 0)
    assert [m.version for m in registry.manifests(RUN)] == [1]
    assert registry.version_of_job(RUN, "big-job") == 1
    assert store.versions(RUN) == [1]
    assert store.verify(RUN, 1).job_id == "big-job"
    assert [p.name for p in store.run_dir(RUN).iterdir()] == ["v000001"]  # no staging left over
    ready = [e for e in EventStream(redis_conn).history() if e.kind is EventKind.ADAPTER_READY]
    assert [(e.version, e.job_id) for e in ready] == [(1, "big-job")]
    assert "job.abandoned job_id=big-job" in second.log()


def _start_on_ghost(conn, job_id: str, ghost: str):
    """Leave `job_id` STARTED by worker `ghost`, as a worker killed mid-job does."""
    from rq import Queue, SimpleWorker

    from tandem.jobs import train_queue

    enqueue(conn, make_job(job_id))
    worker = SimpleWorker([train_queue(conn)], name=ghost, connection=conn, serializer=JSONSerializer)
    worker.register_birth()
    found = Queue.dequeue_any([train_queue(conn)], None, connection=conn, serializer=JSONSerializer)
    assert found is not None
    job, _ = found
    worker.prepare_execution(job)
    worker.prepare_job_execution(job)
    assert job.get_status() == JobStatus.STARTED
    return job


def test_recovery_requeues_only_jobs_of_dead_workers(redis_conn) -> None:
    from tandem.jobs import train_queue
    from tandem_trainer.worker import liveness_key, recover_abandoned

    _start_on_ghost(redis_conn, "job-a", "ghost")
    redis_conn.set(liveness_key("ghost"), "ghost#1", px=60_000)
    assert recover_abandoned(redis_conn) == []  # its worker lives: left alone
    assert status(redis_conn, "job-a") == JobStatus.STARTED

    redis_conn.delete(liveness_key("ghost"))  # the worker died (its key ran out)
    assert recover_abandoned(redis_conn) == ["job-a"]
    job = Job.fetch("job-a", connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.QUEUED and job.retries_left == 2  # one retry used
    assert train_queue(redis_conn).job_ids == ["job-a"]
    assert recover_abandoned(redis_conn) == []  # nothing left to recover


def test_restart_under_the_same_name_recovers_its_own_job(redis_conn) -> None:
    from rq import SimpleWorker

    from tandem_trainer.worker import claim_name, recover_abandoned

    _start_on_ghost(redis_conn, "job-b", "trainer-0")
    again = SimpleWorker([], name="trainer-0", connection=redis_conn, serializer=JSONSerializer)
    with pytest.raises(ValueError, match="active worker"):
        again.register_birth()  # rq refuses a name that looks alive...
    claim_name(redis_conn, "trainer-0")  # ...so, with no liveness key, the stale one is retired
    again.register_birth()
    assert recover_abandoned(redis_conn, dead_names=frozenset({"trainer-0"})) == ["job-b"]
    assert status(redis_conn, "job-b") == JobStatus.QUEUED


def test_a_sigterm_taken_by_another_thread_still_stops_the_idle_worker_soon(workers, redis_conn) -> None:
    """Linux hands a process's SIGTERM to any of its threads that does not block it: usually the
    main thread, but not when that one has a signal pending already. Python runs the handler only
    on the main thread, which sits in rq's wait for the next job (a BLPOP); taken by another
    thread, the warm shutdown waits for that wait to end. The wait is kept short (JOB_WAIT_S), so
    that `docker stop` (10 s to SIGKILL) still finds the worker shutting down warm."""
    worker = workers()
    worker.wait_listening()
    pid = worker.proc.pid
    # kill() on a thread's id sends the process its signal with that thread first in line for it,
    # where that thread does not block it
    takers = [int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid and not _blocks_sigterm(pid, tid)]
    assert takers, "the worker runs threads beside its main one (liveness, metrics) that take SIGTERM"
    sent = time.monotonic()
    os.kill(takers[0], signal.SIGTERM)
    try:
        code = worker.proc.wait(JOB_WAIT_S + WARM_SHUTDOWN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the idle worker still runs {JOB_WAIT_S + WARM_SHUTDOWN_S} s after SIGTERM:\n{worker.log()[-3000:]}")
    assert code == 0 and "warm shut down requested" in worker.log().lower(), worker.log()[-3000:]
    assert time.monotonic() - sent < JOB_WAIT_S + WARM_SHUTDOWN_S


def _blocks_sigterm(pid: int, tid: str) -> bool:
    """Whether the thread `tid` of `pid` blocks SIGTERM (its SigBlk mask in /proc)."""
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))
