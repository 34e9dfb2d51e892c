"""Two inference replicas behind the router, on the local stack: real processes.

redis-server, two transformers engines, two inference services (controller + gateway, each a
replica with its own engine), HAProxy as the router on the gateway port (the configuration the
router image runs, images/router/haproxy.cfg), and the trainer, started by
`tandem.dev.stack.Stack` as `tandem up --replicas 2` does. The loop learns through the router;
every version is loaded on both replicas before it serves; requests spread over both; a replica
killed mid-run costs no request, comes back, reconciles and rejoins; a "ready" heartbeat of a
replica that loads nothing holds train() no longer than the replicas wait for it (`replica.agree_s`).
"""

from __future__ import annotations

import logging
import shutil
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis
from helpers.redis_server import assert_no_refusals
from helpers.traffic import steady_requests
from helpers.waiting import wait_until

from tandem import Client, LoraConfig, OptimizerConfig
from tandem.acl import Role
from tandem.dev import toy
from tandem.dev.composition import StackConfig
from tandem.dev.stack import Stack
from tandem.replicas import Replicas, ReplicaState
from tandem.settings import ReplicaSettings

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("haproxy") is None,
                       reason="the router, HAProxy, is not installed (apt-get install haproxy; .ci/run installs it)"),
]

STEPS = 24  # as many as the compose replicas check: with 18 the last five once came out short of +0.3
PROMPTS = ["Write some numbers.", "Count for me.", "Say something.", "What is the answer?"]


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    config = StackConfig(state_dir=tmp_path_factory.mktemp("stack"), model=str(tiny_model), gateway_port=0, replicas=2)
    with Stack(config) as s:
        yield s
        assert_no_refusals(s.admin_redis_url)  # each service's Redis user allowed all it did


def test_two_replicas_learn_through_the_router_and_agree_on_every_version(stack: Stack, tiny_model: Path) -> None:
    with Client(stack.gateway_url, stack.redis_url) as client:  # closed even when an assert fails
        run = client.create_run("digits-two", base_model=str(tiny_model), lora=LoraConfig(r=8, alpha=16),
                                optimizer=OptimizerConfig(lr=5e-3), max_staleness_steps=0)
        digits = toy.digit_token_ids(tiny_model)
        rewards, replicas_seen = [], Counter()
        for step in range(1, STEPS + 1):
            rolled = toy.roll_out(run, digits, PROMPTS)
            assert set(rolled.versions) == {step - 1}  # train() returned only once both replicas served it
            rewards.append(rolled.mean_reward)
            run.train(rolled.groups, wait=True)
            for prompt in PROMPTS:  # distinct prompts: the router's hash spreads them
                reply = httpx.post(f"{stack.gateway_url}/v1/completions", timeout=30,
                                   json={"model": run.name, "prompt": f"{step} {prompt}", "max_tokens": 1})
                assert reply.status_code == 200 and reply.headers["x-tandem-version"] == str(step)
                replicas_seen[reply.headers["x-tandem-replica"]] += 1
        assert statistics.fmean(rewards[-5:]) >= statistics.fmean(rewards[:5]) + 0.3, [round(r, 3) for r in rewards]
        assert set(replicas_seen) == {"replica-1", "replica-2"}, replicas_seen

        history = run.history()
        for version in range(1, STEPS + 1):
            held = {e.data["replica"]: e.data["held_at"] for e in history if e.kind == "adapter_held" and e.version == version}
            loaded = {e.data["replica"]: e.ts for e in history if e.kind == "adapter_loaded" and e.version == version}
            assert set(loaded) == {"replica-1", "replica-2"}, (version, loaded)
            # neither served it before the other held it: each replica's hold came before the other's switch
            for replica, served_at in loaded.items():
                other = next(r for r in loaded if r != replica)
                assert held.get(other, loaded[other]) <= served_at, (version, held, loaded)


def test_a_killed_replica_costs_no_request_and_rejoins_with_the_newest_version(stack: Stack, tiny_model: Path) -> None:
    with Client(stack.gateway_url, stack.redis_url) as client:  # closed even when an assert fails
        run = client.create_run("digits-kill", base_model=str(tiny_model), lora=LoraConfig(r=8, alpha=16),
                                optimizer=OptimizerConfig(lr=5e-3), max_staleness_steps=0)
        digits = toy.digit_token_ids(tiny_model)
        with steady_requests(stack.gateway_url, run.name) as statuses:
            run.train(toy.roll_out(run, digits, PROMPTS).groups, wait=True)
            stack.kill("inference-2")  # SIGKILL, mid-run: the router retries its requests on replica-1
            for _ in range(3):  # the run keeps training and serving on replica-1 alone
                run.train(toy.roll_out(run, digits, PROMPTS).groups, wait=True)
            assert run.status()["serving_version"] == 4
            stack.restart("inference-2")  # reconciles (loads v4) before its /ready answers 200
            wait_until(lambda: {r.id: r.runs[run.name].serving for r in Replicas(client.conn, prune=False).live()
                                if r.ready and run.name in r.runs} == {"replica-1": 4, "replica-2": 4},
                       60, "replica-2 back in rotation, serving v4")
            run.train(toy.roll_out(run, digits, PROMPTS).groups, wait=True)
            loaded = {e.data["replica"] for e in run.history() if e.kind == "adapter_loaded" and e.version == 5}
            assert loaded == {"replica-1", "replica-2"}
        assert statuses[200] > 0 and set(statuses) == {200}, statuses


def test_a_ready_heartbeat_that_loads_nothing_holds_train_back_only_as_long_as_the_replicas_wait(
        stack: Stack, tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A heartbeat that says "ready" and never loads (stale, forged, or a replica stuck before its
    first load): both real replicas serve each version `replica.agree_s` after holding it, without
    it, and train() returns with them, naming it in a warning; it waited `silent_replica_s` more."""
    caplog.set_level(logging.WARNING, logger="tandem.handles")
    agree_s = ReplicaSettings().agree_s  # the stack's replicas run the default
    with Client(stack.gateway_url, stack.redis_url) as client, \
            redis.Redis.from_url(stack.redis_urls[Role.INFERENCE]) as beater:  # heartbeats: inference's user
        replicas, stop = Replicas(beater), threading.Event()

        def ghost() -> None:
            while not stop.is_set():
                replicas.beat(ReplicaState(id="ghost", url="http://ghost.invalid:8000", ready=True,
                                           started_at=time.time()), ttl_s=10)
                stop.wait(1.0)

        beating = threading.Thread(target=ghost, daemon=True)
        beating.start()
        try:
            run = client.create_run("digits-ghost", base_model=str(tiny_model), lora=LoraConfig(r=8, alpha=16),
                                    optimizer=OptimizerConfig(lr=5e-3), max_staleness_steps=0)
            groups = toy.roll_out(run, toy.digit_token_ids(tiny_model), PROMPTS).groups
            started = time.monotonic()
            result = run.train(groups, wait=True)
            took_s, returned_at = time.monotonic() - started, time.time()
        finally:
            stop.set()
            beating.join()
            replicas.leave("ghost")
        loaded = {e.data["replica"]: e for e in run.history() if e.kind == "adapter_loaded" and e.version == 1}
        assert set(loaded) == {"replica-1", "replica-2"}
        assert all(e.data["without"] == ["ghost"] for e in loaded.values()), {r: e.data for r, e in loaded.items()}
        assert returned_at - max(e.ts for e in loaded.values()) < 5.0  # not silent_replica_s (15 s) after them
        assert took_s < agree_s + result.train_s + 10.0, (took_s, result.train_s)
        assert any("ghost" in r.getMessage() and "not waiting" in r.getMessage() for r in caplog.records)
