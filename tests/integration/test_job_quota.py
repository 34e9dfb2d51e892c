"""Each run's quota of jobs waiting on the train queue (tandem.job_quota): a job beyond it waits to be
enqueued instead of failing, and another run's jobs do not wait for it.

The train queue and Redis are real, each party as its own Redis user (tandem.acl); no trainer
runs: the test takes jobs off the queue as a trainer's worker does (`FairQueue.lmove`, its fair
turn), so it decides when room comes. Through the SDK (`Run.train`) and through the Tinker service
driven over HTTP as the `tinker` SDK drives it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.jobs import make_job
from helpers.servers import Servers
from helpers.tinker_service import API_KEY, tinker_service
from helpers.waiting import wait_until

from tandem import job_quota, tinker_jobs
from tandem.acl import Role
from tandem.client import Client
from tandem.errors import RunQueueFull
from tandem.fair_queue import FairQueue
from tandem.jobs import train_queue
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.settings import ClientSettings

pytestmark = pytest.mark.integration

QUOTA = 2


def take_one(trainer: redis.Redis) -> str:
    """Take the next job off the queue in its fair turn, as a trainer's worker does, and finish it."""
    queue = train_queue(trainer)
    _, job_id = FairQueue.lmove(trainer, queue.key, None)  # type: ignore[misc]
    trainer.lrem(queue.intermediate_queue_key, 0, job_id)
    return job_id.decode() if isinstance(job_id, bytes) else str(job_id)


def client(role_urls: dict[Role, str], **quota: Any) -> Client:
    settings = ClientSettings(gateway_url="http://127.0.0.1:9", run_max_queued_jobs=QUOTA, **quota)
    return Client(redis_url=role_urls[Role.CLIENT], settings=settings)


def test_a_train_beyond_the_runs_quota_waits_for_room_and_another_run_does_not(
    role_urls: dict[Role, str], role_conns: dict[Role, redis.Redis], tiny_model: Path,
) -> None:
    with client(role_urls) as sdk:
        for name in ("eager", "calm"):
            Registry(sdk.conn).create_run(RunSpec(name=name, base_model=str(tiny_model), max_staleness_steps=8))
        eager, calm = sdk.run("eager"), sdk.run("calm")
        for step in range(QUOTA):
            eager.train(make_job(run="eager", seed=step).groups, wait=False)
        outcome: list[object] = []

        def third() -> None:
            try:
                outcome.append(eager.train(make_job(run="eager", seed=9).groups, wait=False))
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                outcome.append(exc)

        waiting = threading.Thread(target=third, daemon=True)
        waiting.start()
        calm.train(make_job(run="calm").groups, wait=False)  # another run: at once, not behind eager
        assert job_quota.queued_jobs(sdk.conn, "calm") == 1
        assert waiting.is_alive() and not outcome and job_quota.queued_jobs(sdk.conn, "eager") == QUOTA

        taken = take_one(role_conns[Role.TRAINER])  # eager's first job, in its fair turn: room for one
        waiting.join(60)
        assert not waiting.is_alive() and len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
        assert job_quota.queued_jobs(sdk.conn, "eager") == QUOTA and taken not in train_queue(sdk.conn).job_ids


def test_a_train_that_finds_no_room_within_its_wait_says_which_quota_and_setting(
    role_urls: dict[Role, str], tiny_model: Path,
) -> None:
    with client(role_urls, queue_wait_s=0.3) as sdk:
        Registry(sdk.conn).create_run(RunSpec(name="stuck", base_model=str(tiny_model), max_staleness_steps=8))
        stuck = sdk.run("stuck")
        for step in range(QUOTA):
            stuck.train(make_job(run="stuck", seed=step).groups, wait=False)
        steps_before = sdk.registry.next_step("stuck")
        with pytest.raises(RunQueueFull) as refused:
            stuck.train(make_job(run="stuck", seed=5).groups, wait=False)
        message = str(refused.value)
        assert "'stuck'" in message and f"run_max_queued_jobs={QUOTA}" in message and "queue_wait_s" in message
        assert job_quota.queued_jobs(sdk.conn, "stuck") == QUOTA  # nothing was enqueued
        assert sdk.registry.next_step("stuck") == steps_before + 1  # and no step number was spent on it


def test_the_tinker_service_parks_a_call_beyond_the_quota_and_enqueues_it_when_room_comes(
    servers: Servers, role_urls: dict[Role, str], role_conns: dict[Role, redis.Redis], tiny_model: Path,
) -> None:
    pytest.importorskip("tinker")
    admin = role_conns[Role.TRAINER]
    with tinker_service(role_urls[Role.TINKER], servers.gateway, poll_wait_s=0.2, run_max_queued_jobs=1) as url, \
            httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}, timeout=60) as http:
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0",
                                                             "type": "create_session"}).json()["session_id"]
        created = http.post("/api/v1/create_model", json={
            "session_id": session, "model_seq_id": 0, "base_model": str(tiny_model),
            "lora_config": {"rank": 4}, "type": "create_model"}).json()
        model_id = wait_for_model(http, created["request_id"])
        body = {"model_id": model_id, "seq_id": 1, "forward_backward_input": {
            "loss_fn": "cross_entropy", "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]},
                                                  "loss_fn_inputs": {"target_tokens": {"data": [4, 5], "dtype": "int64"}}}]}}
        assert http.post("/api/v1/forward_backward", json=body).status_code == 200
        step = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                     "adam_params": {"learning_rate": 1e-4}})
        assert step.status_code == 200  # accepted, not refused: its future waits
        funcs = [j.func_name for j in train_queue(admin).get_jobs()]
        assert funcs == [tinker_jobs.FORWARD_BACKWARD_FUNC]  # the step is parked: the run is at its quota
        pending = http.post("/api/v1/retrieve_future", json={"request_id": step.json()["request_id"]})
        assert pending.status_code == 200 and pending.json()["type"] == "try_again"
        assert len(train_queue(admin).get_jobs()) == 1

        forward = take_one(admin)  # the trainer takes the forward_backward: room for the step
        http.post("/api/v1/retrieve_future", json={"request_id": step.json()["request_id"]})  # the SDK's poll
        jobs = train_queue(admin).get_jobs()
        assert [j.func_name for j in jobs] == [tinker_jobs.OPTIM_STEP_FUNC]
        assert jobs[0].args[0]["gradients_from"] == [forward]  # applied in its turn, with its gradients


def wait_for_model(http: httpx.Client, request_id: str) -> str:
    """The model id a create_model's future resolves to."""
    found: dict[str, Any] = {}

    def resolved() -> bool:
        reply = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        found.update(reply)
        return "model_id" in reply

    wait_until(resolved, 60, "create_model's future")
    return str(found["model_id"])
