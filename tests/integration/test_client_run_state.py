"""A Run's view of itself and the client's refusals before anything is sent: pending jobs once a
handle has its result, a deleted run, a run deleted and created again, bad arguments, and a
delete that meets a job finishing after its version was published.

Redis is real (the client's user); the gateway is not needed, or is an httpx.MockTransport at the
network edge where a test needs one answer of it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis

from tandem import Client
from tandem.errors import RunBusy, RunNotFound, ValidationFailed
from tandem.events import Event, EventKind, EventStream
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.trajectories import Trajectory, TrajectoryGroup

pytestmark = pytest.mark.integration


def group() -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[
        Trajectory(prompt_ids=[1, 2], completion_ids=[3], rollout_logprobs=[-0.5], reward=r) for r in (0.0, 1.0)
    ])


def served(conn: redis.Redis, run: str, version: int, job_id: str) -> None:
    """The trainer's and the inference side's announcements of a version, as the admin appends them."""
    events = EventStream(conn)
    events.append(Event(kind=EventKind.ADAPTER_READY, run=run, version=version, job_id=job_id,
                        data={"path": f"{run}/v{version:06d}/adapter", "step": version, "parent": version - 1,
                              "metrics": {}, "published_at": 1.0, "stepped_at": 0.5}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run=run, version=version, job_id=job_id,
                        data={"adapter": f"{run}-v{version}", "load_ms": 1.0}))


def test_a_job_whose_handle_has_its_result_is_not_pending(redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    Registry(client_conn).create_run(RunSpec(name="pend", base_model="tiny"))
    run = Client("http://127.0.0.1:9", conn=client_conn).run("pend")
    handle = run.train([group()], wait=False)
    assert run.status()["pending_jobs"] == [handle.job_id]
    served(redis_conn, "pend", 1, handle.job_id)
    assert handle.result(timeout_s=10).version == 1
    assert run.status()["pending_jobs"] == []  # as a fresh view of the run says
    assert Client("http://127.0.0.1:9", conn=client_conn).run("pend").status()["pending_jobs"] == []


def test_a_deleted_runs_status_is_run_not_found_and_a_new_run_of_its_name_has_a_history_of_its_own(
    redis_conn: redis.Redis, client_conn: redis.Redis
) -> None:
    from tandem.deletion import delete_run

    Registry(client_conn).create_run(RunSpec(name="again", base_model="tiny"))
    client = Client("http://127.0.0.1:9", conn=client_conn)
    old = client.run("again")
    served(redis_conn, "again", 1, "job-old")
    delete_run(redis_conn, "again")
    with pytest.raises(RunNotFound, match="'again' was deleted"):
        old.status()
    assert [e.kind for e in old.history()] == [EventKind.ADAPTER_READY, EventKind.ADAPTER_LOADED,
                                               EventKind.RUN_DELETED]
    EventStream(redis_conn).append(Event(kind=EventKind.TRAIN_FAILED, run="again", job_id="late",
                                         data={"message": "run 'again' was deleted before the job ran"}))
    assert [e.kind for e in old.history()][-2:] == [EventKind.RUN_DELETED, EventKind.TRAIN_FAILED]  # all of it
    assert len(old.history()) == 4

    Registry(redis_conn).forget_deleted("again")  # the trainer has cleared it: the name may be taken again
    Registry(client_conn).create_run(RunSpec(name="again", base_model="tiny"))
    new = client.run("again")
    assert [e.job_id for e in new.history()] == ["late"]  # after the deletion: the stream cannot tell whose
    served(redis_conn, "again", 1, "job-new")
    assert [(e.kind, e.job_id) for e in new.history()] == [(EventKind.TRAIN_FAILED, "late"),
                                                          (EventKind.ADAPTER_READY, "job-new"),
                                                          (EventKind.ADAPTER_LOADED, "job-new")]
    assert len(client.events.history(run="again")) == 6  # the stream keeps the deleted run's events


@pytest.mark.parametrize("name", ["../runs/victim", "../episodes/abc", "", "a/b", "x@v1"])
def test_delete_run_refuses_a_name_no_run_can_have_before_sending_anything(
    client_conn: redis.Redis, name: str
) -> None:
    sent: list[httpx.Request] = []
    http = httpx.Client(base_url="http://gateway", transport=httpx.MockTransport(
        lambda request: sent.append(request) or httpx.Response(200, json={"run": "victim"})))
    with pytest.raises(ValidationFailed, match=f"run name {name!r} is invalid") as info:
        Client("http://gateway", conn=client_conn, http=http).delete_run(name)
    assert info.value.field == "name" and sent == []


@pytest.mark.parametrize(("call", "field"), [
    (lambda run: run.group([], None), "rewards"),
    (lambda run: run.group(None, [1.0]), "completions"),
    (lambda run: run.train(None), "groups"),
    (lambda run: run.train("groups"), "groups"),
])
def test_arguments_of_the_wrong_type_are_validation_failed_naming_them(
    client_conn: redis.Redis, call: Any, field: str
) -> None:
    Registry(client_conn).create_run(RunSpec(name="types", base_model="tiny"))
    run = Client("http://127.0.0.1:9", conn=client_conn).run("types")
    with pytest.raises(ValidationFailed, match=f"^{field}: got") as info:
        call(run)
    assert info.value.field == field


def test_a_value_json_cannot_carry_is_validation_failed_before_anything_is_sent(client_conn: redis.Redis) -> None:
    Registry(client_conn).create_run(RunSpec(name="json", base_model="tiny"))
    sent: list[httpx.Request] = []
    http = httpx.Client(base_url="http://gateway", transport=httpx.MockTransport(
        lambda request: sent.append(request) or httpx.Response(500)))
    run = Client("http://gateway", conn=client_conn, http=http).run("json")
    with pytest.raises(ValidationFailed, match="JSON cannot carry"):
        run.chat([{"role": "user", "content": object()}])
    assert sent == []


def test_delete_waits_for_a_job_that_published_its_version_to_end(redis_conn: redis.Redis,
                                                                  client_conn: redis.Redis) -> None:
    """train() returns once the version serves; the trainer's job ends a moment later. A delete in
    that moment waits for it instead of answering RunBusy; one whose job has published nothing does not."""
    from tandem.adapters import Manifest

    Registry(client_conn).create_run(RunSpec(name="busy", base_model="tiny"))
    answers = iter([httpx.Response(409, json={"error": {"message": "run 'busy' cannot be deleted while job j1 of it "
                                                                   "runs", "job_id": "j1"}}),
                    httpx.Response(409, json={"error": {"message": "busy", "job_id": "j1"}}),
                    httpx.Response(200, json={"run": "busy", "versions": [1]})])
    http = httpx.Client(base_url="http://gateway", transport=httpx.MockTransport(lambda _: next(answers)))
    client = Client("http://gateway", conn=client_conn, http=http)

    with pytest.raises(RunBusy) as busy:  # nothing published by j1: refused at once
        client.delete_run("busy")
    assert busy.value.job_id == "j1"
    Registry(redis_conn).register_version(Manifest(run="busy", version=1, parent=0, step=1, job_id="j1",
                                                   job_digest="d", base_model="tiny", lora_rank=8))
    assert client.delete_run("busy").versions == [1]  # the second 409 waited on, the third answer taken


@pytest.mark.parametrize("timeout_s", [0, -1, float("inf"), float("nan"), True, "60"])
def test_a_train_wait_that_is_no_number_of_seconds_is_validation_failed_naming_it(
    client_conn: redis.Redis, timeout_s: Any
) -> None:
    Registry(client_conn).create_run(RunSpec(name="waits", base_model="tiny"))
    run = Client("http://127.0.0.1:9", conn=client_conn).run("waits")
    with pytest.raises(ValidationFailed, match="give the seconds to wait, a number above 0") as info:
        run.train([group()], timeout_s=timeout_s)
    assert info.value.field == "timeout_s" and run.status()["pending_jobs"] == []


@pytest.mark.parametrize(("timeout_s", "limit"), [(0.05, 1800), (60, 1800), (7200.5, 7201), (100_000, 86400)])
def test_a_short_wait_does_not_cut_the_jobs_own_time_limit_short(
    client_conn: redis.Redis, timeout_s: float, limit: int
) -> None:
    """The wait is the caller's; the job keeps a limit of its own, so that one still running when
    the wait ends may publish, as TrainTimeout.running says."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    Registry(client_conn).create_run(RunSpec(name="limits", base_model="tiny", max_staleness_steps=8))
    handle = Client("http://127.0.0.1:9", conn=client_conn).run("limits").train([group()], wait=False,
                                                                                timeout_s=timeout_s)
    job = Job.fetch(handle.job_id, connection=client_conn, serializer=JSONSerializer)
    assert job.args[0]["timeout_s"] == limit and job.timeout == limit
