"""Trainers that die at awkward moments, against real worker processes on a real Redis.

The kills are deterministic: a failpoint (`TANDEM_TRAINER_FAILPOINTS`) makes the trainer
SIGKILL itself at a named place, or the test stops and kills it from outside.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers.jobs import RUN, make_job, status
from helpers.workers import wait_for
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem import keys
from tandem.events import EventKind, EventStream
from tandem.jobs import TrainResult, enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, RunSpec

pytestmark = pytest.mark.integration

INTERMEDIATE = f"rq:queue:{keys.TRAIN_QUEUE}:intermediate"
#: The trainers' liveness TTL (`liveness_ttl_s`, 8 s unset): a dead trainer is known dead, and its
#: job handed back, this long after it died.
FAST = {"TANDEM_LIVENESS_TTL_S": "4"}


@pytest.fixture
def registry(redis_conn, tiny_model: Path) -> Registry:
    registry = Registry(redis_conn)
    registry.create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4)))
    return registry


def events(conn, kind: EventKind, job_id: str) -> list:
    return [e for e in EventStream(conn).history() if e.kind is kind and e.job_id == job_id]


def test_a_job_taken_by_a_trainer_that_died_before_starting_it_runs_on_the_next(
        workers, redis_conn, registry: Registry) -> None:
    first = workers(FAST)
    first.wait_listening()
    # "Listening on" is logged before rq cleans its registries and blocks: stop it only once Redis
    # shows it blocked in BLMOVE, so that Redis still hands it the next job.
    wait_for(lambda: any(c["cmd"] == "blmove" for c in redis_conn.client_list()), 30,
             "the trainer to block on the queue", first)
    os.kill(first.proc.pid, signal.SIGSTOP)
    job_id = enqueue(redis_conn, make_job("taken-job"))
    wait_for(lambda: redis_conn.lrange(INTERMEDIATE, 0, -1) == [job_id.encode()], 10,
             "the stopped trainer to take the job", first)
    first.proc.kill()
    first.proc.wait(10)
    assert status(redis_conn, job_id) == JobStatus.QUEUED  # taken, never started

    second = workers(FAST)
    second.wait_listening()
    wait_for(lambda: status(redis_conn, job_id) == JobStatus.FINISHED, 45, "the job to finish", second)
    assert redis_conn.llen(INTERMEDIATE) == 0
    assert registry.version_of_job(RUN, job_id) == 1
    assert "job.stranded job_id=taken-job" in second.log()


def test_a_job_killed_between_register_and_announce_is_announced_by_its_retry(
        workers, redis_conn, registry: Registry) -> None:
    job_id = enqueue(redis_conn, make_job("unannounced"))
    first = workers({**FAST, "TANDEM_TRAINER_FAILPOINTS": "after_register"})
    assert first.wait_dead() == -signal.SIGKILL
    assert registry.version_of_job(RUN, job_id) == 1  # registered...
    assert events(redis_conn, EventKind.ADAPTER_READY, job_id) == []  # ...never announced

    second = workers(FAST)
    wait_for(lambda: status(redis_conn, job_id) == JobStatus.FINISHED, 90, "the retry to finish", second)
    ready = events(redis_conn, EventKind.ADAPTER_READY, job_id)
    assert [(e.run, e.version) for e in ready] == [(RUN, 1)]
    assert ready[0].data["path"] == f"{RUN}/v000001/adapter"
    result = TrainResult.model_validate(Job.fetch(job_id, connection=redis_conn,
                                                  serializer=JSONSerializer).return_value())
    assert (result.version, result.reused) == (1, True)


def test_a_job_whose_version_is_published_ends_finished_even_with_no_retries_left(
        workers, redis_conn, registry: Registry) -> None:
    job_id = enqueue(redis_conn, make_job("published"))
    redis_conn.hset(f"rq:job:{job_id}", "retries_left", 0)  # earlier kills used up its retries
    first = workers({**FAST, "TANDEM_TRAINER_FAILPOINTS": "before_finish"})
    assert first.wait_dead() == -signal.SIGKILL
    assert registry.version_of_job(RUN, job_id) == 1  # published and announced; rq never heard

    second = workers(FAST)
    wait_for(lambda: status(redis_conn, job_id) in (JobStatus.FINISHED, JobStatus.FAILED), 90,
             "the job to end", second)
    assert status(redis_conn, job_id) == JobStatus.FINISHED  # rq agrees with the registry
    result = TrainResult.model_validate(Job.fetch(job_id, connection=redis_conn,
                                                  serializer=JSONSerializer).return_value())
    assert result.version == 1
    assert events(redis_conn, EventKind.TRAIN_FAILED, job_id) == []
    assert len(events(redis_conn, EventKind.ADAPTER_READY, job_id)) == 1


def test_a_job_abandoned_with_no_retries_left_fails_with_an_event(
        workers, redis_conn, registry: Registry) -> None:
    job_id = enqueue(redis_conn, make_job("out-of-retries"))
    redis_conn.hset(f"rq:job:{job_id}", "retries_left", 0)
    first = workers({**FAST, "TANDEM_TRAINER_FAILPOINTS": "mid_training"})
    assert first.wait_dead() == -signal.SIGKILL

    second = workers(FAST)
    wait_for(lambda: status(redis_conn, job_id) == JobStatus.FAILED, 60, "the job to fail", second)
    [failed] = events(redis_conn, EventKind.TRAIN_FAILED, job_id)
    assert failed.run == RUN and failed.data["retries_left"] == 0 and "died" in failed.data["message"]
    assert registry.latest_version(RUN) == 0


def test_a_recovery_lock_left_by_a_dead_trainer_does_not_keep_its_job_abandoned(
        workers, redis_conn, registry: Registry) -> None:
    job_id = enqueue(redis_conn, make_job("lock-left"))
    first = workers({**FAST, "TANDEM_TRAINER_FAILPOINTS": "mid_training", "TANDEM_WORKER_NAME": "trainer"})
    assert first.wait_dead() == -signal.SIGKILL
    # As if it died inside a liveness tick's recovery: the lock names it and lives 30 s more.
    dead_token = redis_conn.get(keys.trainer_alive("trainer")) or b"trainer#0000dead"
    redis_conn.set(keys.TRAINER_RECOVERY, dead_token, px=30_000)

    second = workers({**FAST, "TANDEM_WORKER_NAME": "trainer"})  # the same name: a restarted container
    wait_for(lambda: status(redis_conn, job_id) == JobStatus.FINISHED, 25,
             "the job to finish before the dead trainer's lock would have expired", second)
    assert "recovery.lock_taken_over" in second.log()
    assert "job.abandoned job_id=lock-left" in second.log()
    assert registry.version_of_job(RUN, job_id) == 1
