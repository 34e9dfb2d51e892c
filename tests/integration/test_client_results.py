"""What `Run.train` returns, against a real redis-server and a real rq queue.

The trainer announces a version before it writes the optimizer state, so the version can serve
while its rq job is still running: the result then comes from the job's `adapter_ready` event.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from tandem import Client
from tandem.deletion import delete_run
from tandem.errors import TrainFailed, TrainTimeout
from tandem.events import Event, EventKind, EventStream
from tandem.jobs import STARTED, claim, train_queue
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.trajectories import Trajectory, TrajectoryGroup

pytestmark = pytest.mark.integration


def group() -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[
        Trajectory(prompt_ids=[1, 2], completion_ids=[3], rollout_logprobs=[-0.5], reward=r) for r in (0.0, 1.0)
    ])


def open_run(conn: redis.Redis, name: str):
    """A run registered in Redis, opened by a client with no gateway behind it (none is needed to train);
    `conn` is the client's user's (the tests append the events as the admin)."""
    Registry(conn).create_run(RunSpec(name=name, base_model="tiny"))
    return Client("http://127.0.0.1:9", conn=conn).run(name)


def test_a_version_that_serves_before_its_job_ends_returns_a_whole_result(
    redis_conn: redis.Redis, client_conn: redis.Redis
) -> None:
    run = open_run(client_conn, "early")
    handle = run.train([group()], wait=False)  # queued; no worker: rq has no return value for it
    events = EventStream(redis_conn)
    events.append(Event(
        kind=EventKind.ADAPTER_READY, run="early", version=1, job_id=handle.job_id,
        data={"path": "early/v000001/adapter", "step": 1, "parent": 0, "metrics": {"loss": 0.25, "train_s": 0.4},
              "published_at": 1700000000.5, "stepped_at": 1700000000.25},
    ))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="early", version=1, job_id=handle.job_id,
                        data={"adapter": "early-v1", "load_ms": 3.0}))

    result = handle.result(timeout_s=10)
    assert (result.job_id, result.run, result.version, result.step, result.parent) == (handle.job_id, "early", 1, 1, 0)
    assert result.published_at == 1700000000.5 and result.train_s == 0.4
    assert result.metrics["loss"] == 0.25 and result.metrics["served_at"] > 0


def test_an_adapter_ready_with_unexpected_data_still_gives_the_version(redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    run = open_run(client_conn, "odd")
    handle = run.train([group()], wait=False)
    events = EventStream(redis_conn)
    events.append(Event(kind=EventKind.ADAPTER_READY, run="odd", version=1, job_id=handle.job_id,
                        data={"step": 1, "parent": 0, "metrics": "not a mapping"}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="odd", version=1, job_id=handle.job_id, data={}))

    result = handle.result(timeout_s=10)
    assert (result.version, result.step, result.parent) == (1, 1, 0) and result.published_at > 0


def test_a_run_deleted_after_its_version_was_published_fails_the_wait_at_once(
    redis_conn: redis.Redis, client_conn: redis.Redis
) -> None:
    """The job ended and published its version; the run was deleted before the version served. The
    wait timed out after train_timeout_s (30 min by default), telling the caller to wait again."""
    run = open_run(client_conn, "gone")
    handle = run.train([group()], wait=False)
    train_queue(redis_conn).remove(handle.job_id)  # the trainer took it and ended it
    EventStream(redis_conn).append(Event(kind=EventKind.ADAPTER_READY, run="gone", version=1, job_id=handle.job_id,
                                         data={"step": 1, "parent": 0}))
    assert delete_run(redis_conn, "gone").jobs == []  # not queued: no train_failed for it
    with pytest.raises(TrainFailed, match=r"step 1 will not serve: run 'gone' was deleted after its version 1 was "
                                          r"published, before it served; create the run again") as failed:
        handle.result(timeout_s=20)  # a TrainTimeout after 20 s without the deletion's event
    assert failed.value.field == "run"
    with pytest.raises(TrainFailed, match="was deleted"):  # told again to a later waiter
        run.wait_all(timeout_s=5)


#: Entries anyone with write access to Redis can append to the stream a waiting train() reads.
MALFORMED: list[dict[Any, Any]] = [
    {"kind": "adapter_ready", "run": "noisy", "version": "abc", "ts": "1", "data": "{}"},
    {"kind": "adapter_loaded", "run": "noisy", "version": "-1", "ts": "1"},
    {"kind": "adapter_loaded", "run": "noisy", "version": "1", "ts": "soon"},
    {"kind": "adapter_loaded", "run": "noisy", "version": "1", "ts": "inf"},
    {"kind": "train_failed", "run": "noisy", "ts": "1", "data": "[1, 2]"},
    {"kind": "train_failed", "run": "noisy", "ts": "1", "data": "{not json"},
    {"kind": "adapter_exploded", "run": "noisy", "ts": "1"},
    {"run": "noisy", "ts": "1"},
    {"kind": "adapter_loaded", "run": b"\xff\xfe", "version": "1", "ts": "1"},
    {"junk": "1"},
]


def test_malformed_entries_while_train_waits_are_skipped(redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    run = open_run(client_conn, "noisy")
    handle = run.train([group()], wait=False)
    events = EventStream(redis_conn)

    def trainer_and_inference() -> None:  # with garbage around and between their events
        time.sleep(0.2)
        for fields in MALFORMED:
            redis_conn.xadd("tandem:events", fields)
        events.append(Event(kind=EventKind.ADAPTER_READY, run="noisy", version=1, job_id=handle.job_id,
                            data={"step": 1, "parent": 0, "metrics": {"loss": 0.5}}))
        for fields in MALFORMED:
            redis_conn.xadd("tandem:events", fields)
        events.append(Event(kind=EventKind.ADAPTER_LOADED, run="noisy", version=1, job_id=handle.job_id))

    thread = threading.Thread(target=trainer_and_inference)
    thread.start()
    result = handle.result(timeout_s=20)
    thread.join()
    assert (result.version, result.step, result.metrics["loss"]) == (1, 1, 0.5)


ODD_READY_DATA = {
    "metrics a list": {"step": 1, "parent": 0, "metrics": [1, 2]},
    "metrics a number": {"step": 1, "parent": 0, "metrics": 5},
    "metrics null": {"step": 1, "parent": 0, "metrics": None},
    "metrics of odd values": {"step": 1, "parent": 0, "metrics": {"loss": 0.25, "note": "x", "nested": {"a": 1},
                                                                 "flag": True, "huge": 10**400, "train_s": "fast"}},
    "step a string": {"step": "one", "parent": 0, "metrics": {"loss": 0.25}},
    "parent a list": {"step": 1, "parent": [0], "metrics": {"loss": 0.25}},
    "published_at a string": {"step": 1, "parent": 0, "published_at": "soon", "metrics": {"loss": 0.25}},
    "nothing": {},
}


@pytest.mark.parametrize("data", ODD_READY_DATA.values(), ids=ODD_READY_DATA.keys())
def test_odd_adapter_ready_data_still_gives_the_version_and_the_metrics_that_are_numbers(
    redis_conn: redis.Redis, client_conn: redis.Redis, data: dict[str, Any]
) -> None:
    run = open_run(client_conn, "odd")
    handle = run.train([group()], wait=False)
    events = EventStream(redis_conn)
    events.append(Event(kind=EventKind.ADAPTER_READY, run="odd", version=1, job_id=handle.job_id, data=data))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="odd", version=1, job_id=handle.job_id))

    result = handle.result(timeout_s=10)
    assert result.version == 1 and result.published_at > 0 and result.metrics["served_at"] > 0
    metrics = data.get("metrics")
    if isinstance(metrics, dict):
        assert result.metrics["loss"] == 0.25
        assert not {"note", "nested", "flag", "huge", "train_s"} & set(result.metrics)


def test_an_rq_result_that_is_not_a_train_result_falls_back_to_the_event(
    redis_conn: redis.Redis, client_conn: redis.Redis
) -> None:
    run = open_run(client_conn, "rqodd")
    handle = run.train([group()], wait=False)
    job = Job.fetch(handle.job_id, connection=redis_conn, serializer=JSONSerializer)
    Result.create(job, Result.Type.SUCCESSFUL, ttl=60, return_value={"not": "a train result"})
    events = EventStream(redis_conn)
    events.append(Event(kind=EventKind.ADAPTER_READY, run="rqodd", version=1, job_id=handle.job_id,
                        data={"step": 1, "parent": 0, "metrics": {"loss": 0.5}}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="rqodd", version=1, job_id=handle.job_id))

    result = handle.result(timeout_s=10)
    assert (result.job_id, result.version, result.metrics["loss"]) == (handle.job_id, 1, 0.5)


def test_threads_sharing_a_run_each_get_results_and_nothing_else(redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    """Several threads waiting on one Run's pending jobs: each job's outcome goes to one of them (the
    one that takes it off), none sees an IndexError from another thread's wait."""
    Registry(redis_conn).create_run(RunSpec(name="shared", base_model="tiny", max_staleness_steps=64))
    run = Client("http://127.0.0.1:9", conn=client_conn).run("shared")
    handles = [run.train([group()], wait=False) for _ in range(24)]
    events = EventStream(redis_conn)
    for version, handle in enumerate(handles, 1):
        if version == 24:
            events.append(Event(kind=EventKind.TRAIN_FAILED, run="shared", version=version, job_id=handle.job_id,
                                data={"message": "boom", "field": None, "retries_left": 0}))
            continue
        events.append(Event(kind=EventKind.ADAPTER_READY, run="shared", version=version, job_id=handle.job_id,
                            data={"path": f"shared/v{version:06d}/adapter", "step": version, "parent": version - 1,
                                  "metrics": {}, "published_at": 1.0, "stepped_at": 0.5}))
        events.append(Event(kind=EventKind.ADAPTER_LOADED, run="shared", version=version, job_id=handle.job_id,
                            data={"adapter": f"shared-v{version}", "load_ms": 1.0}))
    outcomes: list[Any] = []
    start = threading.Barrier(8)

    def wait() -> None:
        start.wait()
        try:
            outcomes.append(sorted(r.version for r in run.wait_all(timeout_s=20)))
        except Exception as exc:  # noqa: BLE001 - what each thread saw is the assertion
            outcomes.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [o for o in outcomes if isinstance(o, Exception)]
    assert len(outcomes) == 8 and len(errors) == 1 and type(errors[0]).__name__ == "TrainFailed", outcomes
    assert "boom" in str(errors[0])
    seen = sorted(v for o in outcomes if isinstance(o, list) for v in o)
    assert seen == list(range(1, 24)) or (len(seen) == len(set(seen)) and set(seen) <= set(range(1, 24))), seen
    assert run.status()["pending_jobs"] == []
    assert [h.result(timeout_s=1).version for h in handles[:23]] == list(range(1, 24))


def test_train_waits_for_its_own_job_and_leaves_a_later_one_of_another_thread_to_it(
    redis_conn: redis.Redis, client_conn: redis.Redis
) -> None:
    """train(wait=True) in one thread returns its own step's result, not the failure of a step
    another thread sharing the Run submitted after it; that thread hears of its failure itself."""
    Registry(redis_conn).create_run(RunSpec(name="mine", base_model="tiny", max_staleness_steps=64))
    run = Client("http://127.0.0.1:9", conn=client_conn).run("mine")
    outcome: list[Any] = []

    def train() -> None:
        try:
            outcome.append(run.train([group()], timeout_s=20))
        except Exception as exc:  # noqa: BLE001 - what the thread saw is the assertion
            outcome.append(exc)

    waiter = threading.Thread(target=train)
    waiter.start()
    deadline = time.monotonic() + 10
    while not run.status()["pending_jobs"] and time.monotonic() < deadline:
        time.sleep(0.01)
    (first,) = run.status()["pending_jobs"]
    later = run.train([group()], wait=False)  # this thread's, submitted after the waiting one
    events = EventStream(redis_conn)
    events.append(Event(kind=EventKind.TRAIN_FAILED, run="mine", job_id=later.job_id,
                        data={"message": "boom", "field": None, "retries_left": 0}))
    events.append(Event(kind=EventKind.ADAPTER_READY, run="mine", version=1, job_id=first,
                        data={"path": "mine/v000001/adapter", "step": 1, "parent": 0, "metrics": {},
                              "published_at": 1.0, "stepped_at": 0.5}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="mine", version=1, job_id=first,
                        data={"adapter": "mine-v1", "load_ms": 1.0}))
    waiter.join(30)

    assert [getattr(o, "version", o) for o in outcome] == [1]
    assert run.status()["pending_jobs"] == [later.job_id]  # its failure waits for its own thread
    with pytest.raises(TrainFailed, match="step 2 failed: boom"):
        run.wait_all(timeout_s=5)
    assert run.status()["pending_jobs"] == []


def test_a_timeout_cancels_a_job_the_trainer_has_not_started(redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    """So that submitting the same groups again trains them once (the first job ran later and
    published too)."""
    run = open_run(client_conn, "late")
    handle = run.train([group()], wait=False)
    with pytest.raises(TrainTimeout) as info:
        run.wait_all(timeout_s=1)
    assert "not started and is cancelled" in str(info.value) and not info.value.running
    assert Job.fetch(handle.job_id, connection=redis_conn, serializer=JSONSerializer).get_status() == "canceled"
    assert run.status()["pending_jobs"] == []


def test_a_timeout_does_not_cancel_a_job_a_worker_has_just_taken(redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    """rq still says queued, but a worker has claimed the job to start it: the client says it runs."""
    run = open_run(client_conn, "taken")
    handle = run.train([group()], wait=False)
    job = Job.fetch(handle.job_id, connection=redis_conn, serializer=JSONSerializer)
    assert claim(redis_conn, job.key, STARTED) == STARTED  # as the worker claims what it took
    with pytest.raises(TrainTimeout) as info:
        run.wait_all(timeout_s=1)
    assert info.value.running and "wait on it again" in str(info.value)
    assert job.get_status(refresh=True) == "queued"  # not cancelled


def test_a_timeout_of_a_job_the_trainer_runs_keeps_it_to_wait_on(redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    run = open_run(client_conn, "slow")
    handle = run.train([group()], wait=False)
    job = Job.fetch(handle.job_id, connection=redis_conn, serializer=JSONSerializer)
    job.set_status("started")  # as a worker marks the job it runs
    with pytest.raises(TrainTimeout) as info:
        run.wait_all(timeout_s=1)
    assert info.value.running and "wait on it again" in str(info.value)
    assert run.status()["pending_jobs"] == [handle.job_id]  # still pending, in its place
    events = EventStream(redis_conn)
    events.append(Event(kind=EventKind.ADAPTER_READY, run="slow", version=1, job_id=handle.job_id,
                        data={"path": "slow/v000001/adapter", "step": 1, "parent": 0, "metrics": {},
                              "published_at": 1.0, "stepped_at": 0.5}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="slow", version=1, job_id=handle.job_id,
                        data={"adapter": "slow-v1", "load_ms": 1.0}))
    assert [r.version for r in run.wait_all(timeout_s=10)] == [1]


def test_a_train_that_times_out_behind_a_running_job_names_its_own_job_and_hands_it_back(
        redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    """train() waits on the run's earlier jobs first: when one of them is still running at the
    timeout, the error used to name that job and say "wait on it (handle.result())", with no
    handle to this call's job, which it had submitted."""
    run = open_run(client_conn, "behind")
    earlier = run.train([group()], wait=False)
    Job.fetch(earlier.job_id, connection=redis_conn, serializer=JSONSerializer).set_status("started")
    with pytest.raises(TrainTimeout) as info:
        run.train([group()], timeout_s=0.5)
    mine = info.value.handle
    assert mine is not None and info.value.job_id == mine.job_id != earlier.job_id
    message = str(info.value)
    assert message.startswith(f"job {mine.job_id} (run 'behind', step 2) did not serve within 0.5 s: it waits "
                              f"behind job {earlier.job_id} (step 1)")
    assert "not started and is cancelled" in message and not info.value.running  # as a timeout of its own
    assert Job.fetch(mine.job_id, connection=redis_conn, serializer=JSONSerializer).get_status() == "canceled"
    assert run.status()["pending_jobs"] == [earlier.job_id]


FIELD = "groups.0.trajectories.1.completion_ids"


@pytest.mark.parametrize(("field", "expected"), [(FIELD, FIELD), (None, None), (7, None)])
def test_a_failed_step_names_the_field_the_trainer_refused(redis_conn: redis.Redis, client_conn: redis.Redis, field: Any,
                                                           expected: str | None) -> None:
    run = open_run(client_conn, "refused")
    handle = run.train([group()], wait=False)
    EventStream(redis_conn).append(Event(
        kind=EventKind.TRAIN_FAILED, run="refused", job_id=handle.job_id,
        data={"message": "token id 99999 is outside the vocabulary", "field": field, "retries_left": 0},
    ))
    with pytest.raises(TrainFailed, match="step 1 failed: token id 99999") as info:
        handle.result(timeout_s=10)
    assert info.value.field == expected


def test_a_pipelined_train_that_raises_an_earlier_failure_hands_back_its_own_job(
        redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    """train(wait=False) submits its job, then waits on the oldest pending ones (max_staleness_steps):
    an earlier job's failure raised there used to read as this call's, with no handle to the job it
    had queued, so a caller that retried trained that step twice."""
    run = open_run(client_conn, "pipelined")
    first = run.train([group()], wait=False)
    EventStream(redis_conn).append(Event(
        kind=EventKind.TRAIN_FAILED, run="pipelined", job_id=first.job_id,
        data={"message": "stale rollouts", "field": "groups.0.trajectories.0.version", "retries_left": 0},
    ))
    with pytest.raises(TrainFailed) as info:
        run.train([group()], wait=False, timeout_s=10)
    mine = info.value.submitted
    assert mine is not None and mine.job_id != first.job_id and mine.step == 2
    assert str(info.value).startswith("step 1 failed: stale rollouts")
    assert f"this call's own job {mine.job_id}, step 2, was submitted and is pending" in str(info.value)
    assert info.value.field == "groups.0.trajectories.0.version"
    assert run.status()["pending_jobs"] == [mine.job_id]

    # the same with a train() that waits: it waits on its thread's earlier jobs first
    EventStream(redis_conn).append(Event(
        kind=EventKind.TRAIN_FAILED, run="pipelined", job_id=mine.job_id,
        data={"message": "stale again", "field": None, "retries_left": 0},
    ))
    with pytest.raises(TrainFailed) as info:
        run.train([group()], timeout_s=10)
    waited = info.value.submitted
    assert waited is not None and waited.step == 3 and str(info.value).startswith("step 2 failed: stale again")
    assert f"this call's own job {waited.job_id}, step 3, was submitted" in str(info.value)
