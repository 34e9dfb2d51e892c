"""Two inference replicas behind the router, as containers: compose.replicas.yaml (+ -cpu) on the CPU stack.

Each replica is an `inference` container with its own transformers engine; the router (HAProxy)
takes the published gateway port and finds the replicas through compose's DNS. The loop learns
through the router; every version is held by both replicas before it serves; requests spread
over both; a replica SIGKILLed mid-run costs no request (the router sends its requests to the
other), and once started again (`docker start`: a `docker kill` is not restarted by policy) it
reconciles and rejoins; a third replica that cannot load the run's versions (its engine takes a
lower LoRA rank) stays out of rotation and holds nothing back. (A ready replica that refuses a
version and then leaves rotation is shown on real processes in
tests/integration/test_replica_agreement.py.)
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from compose_stack import MODEL, ComposeStack, started_stack, wait_for
from helpers.traffic import steady_requests

from tandem import Client, LoraConfig, OptimizerConfig
from tandem.dev import toy
from tandem.replicas import Replicas

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["Write some numbers.", "Count for me.", "Say something.", "What is the answer?"]
STEPS = 24


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    yield from started_stack(request, tmp_path_factory, files=("compose.replicas.yaml", "compose.replicas-cpu.yaml"),
                             env="INFERENCE_REPLICAS=2\n", services=("redis", "inference", "router", "trainer"))


def ready_replicas(client: Client, run: str) -> dict[str, int]:
    """Ready replica -> the version of `run` it serves."""
    return {r.id: r.runs[run].serving for r in Replicas(client.conn, prune=False).live() if r.ready and run in r.runs}


def test_two_replicas_learn_through_the_router_and_agree_on_every_version(
    stack: ComposeStack, client: Client, digits: frozenset[int],
) -> None:
    assert len(stack.containers("inference")) == 2
    run = client.create_run("digits", base_model=MODEL, lora=LoraConfig(r=8, alpha=16),
                            optimizer=OptimizerConfig(lr=5e-3), max_staleness_steps=0)
    rewards, seen = [], Counter[str]()
    for step in range(1, STEPS + 1):
        rolled = toy.roll_out(run, digits, PROMPTS)
        assert set(rolled.versions) == {step - 1}  # train() returned once both replicas served it
        rewards.append(rolled.mean_reward)
        run.train(rolled.groups, wait=True)
        for prompt in PROMPTS:
            reply = httpx.post(f"{stack.gateway_url}/v1/completions", timeout=30,
                               json={"model": run.name, "prompt": f"{step} {prompt}", "max_tokens": 1})
            assert reply.status_code == 200 and reply.headers["x-tandem-version"] == str(step)
            seen[reply.headers["x-tandem-replica"]] += 1
    assert statistics.fmean(rewards[-5:]) >= statistics.fmean(rewards[:5]) + 0.3, [round(r, 3) for r in rewards]
    assert len(seen) == 2, seen  # requests spread over both replicas

    history = run.history()
    for version in range(1, STEPS + 1):
        held = {e.data["replica"]: e.data["held_at"] for e in history if e.kind == "adapter_held" and e.version == version}
        loaded = {e.data["replica"]: e.ts for e in history if e.kind == "adapter_loaded" and e.version == version}
        assert len(loaded) == 2, (version, loaded)
        for replica, served_at in loaded.items():  # neither served it before the other held it
            other = next(r for r in loaded if r != replica)
            assert held.get(other, loaded[other]) <= served_at, (version, held, loaded)


def test_each_replicas_engine_listens_on_its_loopback_only(stack: ComposeStack) -> None:
    probe = ("import socket, sys\ns = socket.socket(); s.settimeout(3)\n"
             "print(s.connect_ex((sys.argv[1], 30000)))")
    for cid in stack.containers("inference"):
        ip = stack.docker("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", cid).strip()
        assert stack.exec("trainer", "python", "-c", probe, ip).strip() != "0", f"engine of {cid} open on {ip}"
        assert stack.docker("exec", cid, "python", "-c", probe, "127.0.0.1").strip() == "0"


def test_a_replica_killed_mid_run_costs_no_request_and_rejoins(
    stack: ComposeStack, client: Client, digits: frozenset[int],
) -> None:
    run = client.run("digits")
    start = run.status()["serving_version"]
    victim = stack.containers("inference")[1]
    with steady_requests(stack.gateway_url, run.name) as statuses:
        stack.docker("kill", "--signal", "KILL", victim)
        for _ in range(2):  # the run goes on while the replica is down
            run.train(toy.roll_out(run, digits, PROMPTS).groups, wait=True)
        stack.docker("start", victim)
        newest = start + 2
        wait_for(lambda: set(ready_replicas(client, run.name).values()) == {newest}
                 and len(ready_replicas(client, run.name)) == 2, 180, f"both replicas ready, serving v{newest}")
        run.train(toy.roll_out(run, digits, PROMPTS).groups, wait=True)
        loaded = {e.data["replica"] for e in run.history() if e.kind == "adapter_loaded" and e.version == newest + 1}
        assert len(loaded) == 2, loaded
    assert statuses[200] > 0 and set(statuses) == {200}, statuses


def test_a_replica_that_cannot_load_the_versions_stays_out_of_rotation_and_stalls_nothing(
    stack: ComposeStack, client: Client, digits: frozenset[int],
) -> None:
    # a third replica whose engine takes LoRA rank 4 at most: it refuses the run's rank-8 versions
    stack.compose("run", "-d", "--no-deps", "--name", f"{stack.project}-refuser", "-e", "TANDEM_REPLICA__ID=refuser",
                  "-e", "TANDEM_ENGINE__MAX_LORA_RANK=4", "inference")
    run = client.run("digits")
    newest = run.status()["serving_version"]

    def refused_the_newest() -> bool:
        return any(e.kind == "adapter_rejected" and e.data.get("replica") == "refuser" and e.version == newest
                   for e in run.history())

    wait_for(lambda: refused_the_newest() and any(r.id == "refuser" for r in Replicas(client.conn, prune=False).live()), 180,
             "the third replica up, refusing the newest version")
    [refuser] = [r for r in Replicas(client.conn, prune=False).live() if r.id == "refuser"]
    assert not refuser.ready  # reconciling, then behind: never in rotation
    assert run.name not in refuser.runs or refuser.runs[run.name].serving == 0
    rejected = [e for e in run.history() if e.kind == "adapter_rejected" and e.data.get("replica") == "refuser"]
    assert rejected and "max_lora_rank 4" in rejected[-1].data["message"]

    result = run.train(toy.roll_out(run, digits, PROMPTS).groups, wait=True)  # not held back by the refuser
    assert result.version == newest + 1
    loaded = {e.data["replica"] for e in run.history() if e.kind == "adapter_loaded" and e.version == result.version}
    assert len(loaded) == 2 and "refuser" not in loaded
    wait_for(lambda: ready_replicas(client, run.name) == dict.fromkeys(loaded, result.version), 30,
             "the two replicas' heartbeats to show the new version")  # written just after adapter_loaded
    stack.docker("rm", "-f", f"{stack.project}-refuser")
