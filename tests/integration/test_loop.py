"""The whole loop on the local stack: rollouts -> GRPO -> versioned adapter -> hot-load -> better rollouts.

Real processes: redis-server, the transformers engine, the inference service (controller +
gateway) and the trainer worker, started by `tandem.dev.stack.Stack` exactly as `tandem up` does.
"""

from __future__ import annotations

import signal
import statistics
from pathlib import Path

import httpx
import pytest
from helpers.redis_server import assert_no_refusals
from helpers.waiting import wait_until

from tandem import Client, LoraConfig, OptimizerConfig, TrainHandle, TrainJob, TrainResult, jobs
from tandem.dev import toy
from tandem.dev.composition import StackConfig
from tandem.dev.stack import Stack
from tandem.errors import TrainFailed, ValidationFailed
from tandem.replicas import Replicas, ReplicaState, RunHolding

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = ["Write some numbers.", "Count for me.", "Say something.", "What is the answer?"]


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    with Stack(StackConfig(state_dir=tmp_path_factory.mktemp("stack"), model=str(tiny_model), gateway_port=0)) as s:
        yield s
        assert_no_refusals(s.admin_redis_url)  # each service's Redis user allowed all it did


def play(run, digits: frozenset[int], steps: int, *, wait: bool) -> list[dict]:
    """Roll out, score, train; returns per step the mean reward and the versions that served."""
    rows = []
    for step in range(1, steps + 1):
        rolled = toy.roll_out(run, digits, PROMPTS)
        result = run.train(rolled.groups, wait=wait)
        rows.append({"step": step, "reward": rolled.mean_reward, "versions": rolled.versions, "result": result})
    run.wait_all()
    return rows


def test_sync_loop_learns_and_serves_each_new_version(stack: Stack, tiny_model: Path) -> None:
    with Client(stack.gateway_url, stack.redis_url) as client:
        run = client.create_run("digits-sync", base_model=str(tiny_model), lora=LoraConfig(r=8, alpha=16),
                                optimizer=OptimizerConfig(lr=5e-3), max_staleness_steps=0)
        rows = play(run, toy.digit_token_ids(tiny_model), 22, wait=True)
        first = statistics.fmean(r["reward"] for r in rows[:5])
        last = statistics.fmean(r["reward"] for r in rows[-5:])
        assert last >= first + 0.3, [round(r["reward"], 3) for r in rows]
        # synchronous: step k's rollouts were all served by version k-1, the newest one
        for r in rows:
            assert set(r["versions"]) == {r["step"] - 1}
            # the result is whole even when train() returns before the job wrote its optimizer state
            result = r["result"]
            assert (result.version, result.step, result.parent) == (r["step"], r["step"], r["step"] - 1)
            assert 0 < result.published_at <= result.metrics["served_at"] and result.train_s > 0
        assert run.status()["serving_version"] == 22
        loaded = [e for e in run.history() if e.kind == "adapter_loaded"]
        assert [e.version for e in loaded] == list(range(1, 23))
        assert all(e.data["load_ms"] > 0 for e in loaded)


def test_async_loop_never_serves_rollouts_older_than_max_staleness(stack: Stack, tiny_model: Path) -> None:
    with Client(stack.gateway_url, stack.redis_url) as client:
        run = client.create_run("digits-async", base_model=str(tiny_model), lora=LoraConfig(r=8, alpha=16),
                                optimizer=OptimizerConfig(lr=5e-3), max_staleness_steps=1)
        rows = play(run, toy.digit_token_ids(tiny_model), 14, wait=False)
        for r in rows:
            parent = r["step"] - 1  # the job of step k trains on version k-1
            assert all(parent - v <= 1 for v in r["versions"]), (r["step"], sorted(set(r["versions"])))
        assert not [e for e in run.history() if e.kind in ("train_failed", "adapter_rejected")]
        assert run.status()["serving_version"] == 14


def test_one_runs_rollouts_never_train_another_run(stack: Stack, tiny_model: Path) -> None:
    """Completions of run alpha handed to beta are refused naming both runs: by the client before
    it enqueues, and by the trainer for a job any client enqueued. Nothing is published for beta,
    and the worker goes on to train beta on its own rollouts."""
    digits = toy.digit_token_ids(tiny_model)
    with Client(stack.gateway_url, stack.redis_url) as client:
        alpha, beta = (client.create_run(name, base_model=str(tiny_model), lora=LoraConfig(r=4),
                                         max_staleness_steps=1) for name in ("alpha", "beta"))
        for run in (alpha, beta):
            play(run, digits, 1, wait=True)  # each serves its v1: version numbers alone tell nothing
        foreign = toy.roll_out(alpha, digits, PROMPTS[:2], group_size=4, max_tokens=8)
        assert set(foreign.versions) == {1}
        message = "sampled from run 'alpha' (v1); this job trains run 'beta': train each run on its own rollouts"
        with pytest.raises(ValidationFailed) as refused:
            beta.train(foreign.groups)
        assert refused.value.field == "groups.0.trajectories.0.origin.run" and message in str(refused.value)

        job = TrainJob(run="beta", step=2, groups=foreign.groups, timeout_s=120)
        handle = TrainHandle(run=beta, job_id=job.job_id, step=job.step, after=client.events.last_id())
        jobs.enqueue(client.conn, job)  # as a client without the check would
        with pytest.raises(TrainFailed) as failed:
            handle.result(120)
        assert failed.value.field == "groups.0.trajectories.0.origin.run" and message in str(failed.value)
        assert client.registry.latest_version("beta") == 1
        assert not [e for e in beta.history() if e.kind == "adapter_ready" and e.version > 1]
        assert [e.job_id for e in beta.history() if e.kind == "train_failed"] == [job.job_id]  # the client sent none

        own = toy.roll_out(beta, digits, PROMPTS[:2], group_size=4, max_tokens=8)
        result = beta.train(own.groups)
        assert isinstance(result, TrainResult) and (result.version, result.parent) == (2, 1)


def test_the_inference_service_reports_itself_as_a_replica(stack: Stack, tiny_model: Path) -> None:
    with Client(stack.gateway_url, stack.redis_url) as client:
        run = client.create_run("replica-seen", base_model=str(tiny_model), lora=LoraConfig(r=4))
        play(run, toy.digit_token_ids(tiny_model), 1, wait=True)

        def heartbeat_serves_v1() -> list[ReplicaState]:
            live = Replicas(client.conn, prune=False).live()
            return live if live and live[0].runs.get(run.name, RunHolding()).serving == 1 else []

        wait_until(heartbeat_serves_v1, 30, "the replica's heartbeat to show v1 serving")
        [replica] = Replicas(client.conn, prune=False).live()
        assert replica.ready and replica.runs[run.name].loaded == [1]
        assert replica.url.endswith(":" + stack.gateway_url.rsplit(":", 1)[1])
        [loaded] = [e for e in run.history() if e.kind == "adapter_loaded"]
        assert loaded.data["replica"] == replica.id
        reply = httpx.post(f"{stack.gateway_url}/v1/completions", json={"model": run.name, "prompt": "1", "max_tokens": 1},
                           timeout=30)
        assert reply.headers["x-tandem-replica"] == replica.id and reply.headers["x-tandem-version"] == "1"


def test_service_logs_are_one_format_without_the_polls(stack: Stack, tiny_model: Path) -> None:
    """Access lines carry the time like every other line; the controller's health polls of the
    engine and its model checks are not logged, the requests are."""
    with Client(stack.gateway_url, stack.redis_url) as client:
        run = client.create_run("logged", base_model=str(tiny_model), lora=LoraConfig(r=4))
        run.chat([{"role": "user", "content": "hi"}], max_tokens=2)
    bad = httpx.post(f"{stack.gateway_url}/v1/chat/completions", timeout=30,
                     json={"model": "logged", "messages": [{"role": "user", "content": "x"}], "temperature": "hot\nline"})
    assert bad.status_code == 422
    refused = [line for line in (stack.logs / "inference.log").read_text().splitlines() if "request.refused" in line]
    assert [line for line in refused if "status=422 path=/v1/chat/completions param=temperature" in line], refused
    for service in ("engine", "inference"):
        lines = (stack.logs / f"{service}.log").read_text().splitlines()
        assert not [line for line in lines if line.startswith("INFO:")], (service, lines[:5])
        assert not [line for line in lines if '"GET /health HTTP/1.1" 200' in line], service
        posts = [line for line in lines if '"POST /' in line and " INFO uvicorn.access " in line]
        assert posts and all(line[:4].isdigit() for line in posts), (service, lines[-5:])


def test_a_deleted_run_leaves_the_stack_and_the_other_runs_stay(stack: Stack, tiny_model: Path) -> None:
    """Deleting a run on the running stack: the gateway answers 404 for it, its adapter leaves the
    engine, the trainer removes its directory and the name is free again; the other run serves on,
    its files byte for byte."""
    store = stack.state / "adapters"

    def files(run: str) -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in sorted((store / run).rglob("*")) if p.is_file()}

    with Client(stack.gateway_url, stack.redis_url) as client:
        gone, kept = (client.create_run(name, base_model=str(tiny_model), lora=LoraConfig(r=4))
                      for name in ("deleted", "kept"))
        for run in (gone, kept):
            play(run, toy.digit_token_ids(tiny_model), 1, wait=True)
        kept_files = files("kept")
        assert client.delete_run("deleted").versions == [1]
        reply = httpx.post(f"{stack.gateway_url}/v1/completions", timeout=30,
                           json={"model": "deleted", "prompt": "1", "max_tokens": 1})
        assert reply.status_code == 404 and "'deleted'" in reply.text
        wait_until(lambda: not (store / "deleted").exists() and not client.registry.deleted_runs(), 30,
                   "the trainer to remove the deleted run's directory")
        wait_until(lambda: "adapter_unload end run=deleted " in (stack.logs / "inference.log").read_text(), 30,
                   "the deleted run's adapter to leave the engine")
        assert files("kept") == kept_files
        assert [c.version for c in kept.chat([{"role": "user", "content": "hi"}], max_tokens=2)] == [1]
        assert client.create_run("deleted", base_model=str(tiny_model)).status()["latest_version"] == 0


def test_while_redis_hangs_the_gateway_and_the_trainers_metrics_answer_within_a_scrape(stack: Stack) -> None:
    """A hung Redis (SIGSTOP: connections open, no answers) must not hold a gateway request or a
    Prometheus scrape (10 s timeout) for the 30 s of a Redis command's timeout. Last in the module."""
    redis_proc = stack.service("redis").proc
    assert redis_proc is not None
    trainer_metrics = f"http://127.0.0.1:{stack.trainer_metrics_port}/metrics"
    redis_proc.send_signal(signal.SIGSTOP)
    try:
        with httpx.Client(timeout=10) as http:  # an answer after 10 s is a ReadTimeout here
            unknown = http.get(f"{stack.gateway_url}/v1/runs/no-such-run")
            assert unknown.status_code in (404, 503), unknown.text
            scraped = http.get(trainer_metrics)
            assert scraped.status_code == 200 and "tandem_trainer_queue_depth NaN" in scraped.text
    finally:
        redis_proc.send_signal(signal.SIGCONT)
    wait_until(lambda: httpx.get(f"{stack.gateway_url}/ready", timeout=5).status_code == 200, 60, "ready again")
