"""Versions across inference replicas, against a real redis-server, real engines and controllers.

A replica that loaded a new version holds it until every other ready replica holds it too, then
serves it; one that refuses a version leaves rotation instead of holding the run back; and a
client's train() returns only when every ready replica serves its version.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis
from helpers.adapters import announce, publish
from helpers.loopback import serve_app

from tandem import Client
from tandem.acl import Role
from tandem.adapters import AdapterStore
from tandem.errors import TrainFailed, TrainTimeout
from tandem.events import Event, EventKind, EventStream
from tandem.registry import Registry
from tandem.replicas import Replicas, ReplicaState, RunHolding
from tandem.runs import RunSpec
from tandem.settings import (
    ControllerSettings,
    EngineSettings,
    InferenceSettings,
    RedisSettings,
    ReplicaSettings,
    StoreSettings,
)
from tandem.trajectories import Trajectory, TrajectoryGroup
from tandem_inference.controller.heartbeat import Heartbeat
from tandem_inference.controller.service import Controller
from tandem_inference.engines.transformers.client import TransformersEngine
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_inference.routing import RoutingTable

pytestmark = pytest.mark.integration


async def wait_until(check: Callable[[], bool], *, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def events_of(conn: redis.Redis, kind: EventKind, run: str) -> list[Event]:
    return [e for e in EventStream(conn).history(run=run) if e.kind is kind]


class Replica:
    """One inference replica as the service runs it: an engine, a controller and a heartbeat."""

    def __init__(self, settings: InferenceSettings, conn: redis.Redis, engine: TransformersEngine) -> None:
        self.settings = settings
        self.table = RoutingTable(settings.engine.model)
        self.controller = Controller(settings, conn, engine, AdapterStore(settings.store.root), self.table)
        self.heartbeat = Heartbeat(settings, conn, self.table, ready=self.ready)
        self.controller.on_change = self.heartbeat.beat
        self.tasks: list[asyncio.Task[None]] = []

    async def ready(self) -> bool:
        return self.controller.reconciled and self.controller.agreement.in_rotation

    def start(self) -> None:
        self.tasks = [self.controller.start(), asyncio.create_task(self.heartbeat.run())]

    async def stop(self) -> None:
        await self.controller.stop()
        for task in self.tasks[1:]:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
def engine_urls(tiny_model: Path) -> Iterator[dict[str, str]]:
    """Two engines: replica a's takes rank 64, replica b's only rank 4 (so b refuses rank-8 adapters)."""
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(serve_app(create_engine_app(
                EngineSettings(model=str(tiny_model), device="cpu", max_lora_rank=rank))))
            for name, rank in (("a", 64), ("b", 4))
        }


@pytest.fixture
async def replicas(role_urls: dict[Role, str], redis_conn: redis.Redis, tmp_path: Path, tiny_model: Path,
                   engine_urls: dict[str, str]) -> AsyncIterator[Callable[..., Awaitable[dict[str, Replica]]]]:
    started: list[Replica] = []
    conns: list[redis.Redis] = []
    async with httpx.AsyncClient() as http:

        async def start(agree_s: float = 60.0, names: tuple[str, ...] = ("a", "b")) -> dict[str, Replica]:
            out = {}
            for name in names:
                settings = InferenceSettings(
                    redis=RedisSettings(url=role_urls[Role.INFERENCE]),  # as the inference's Redis user
                    store=StoreSettings(root=tmp_path / "store"),
                    engine=EngineSettings(url=engine_urls[name], model=str(tiny_model), max_lora_rank=64),
                    controller=ControllerSettings(block_ms=50, reconcile_s=0.5),
                    replica=ReplicaSettings(id=f"replica-{name}", url=f"http://{name}.invalid:8000",
                                            heartbeat_s=0.2, agree_s=agree_s),
                )
                conn = settings.redis.connect()
                conns.append(conn)
                replica = Replica(settings, conn, TransformersEngine(http, engine_urls[name]))
                replica.start()
                out[name] = replica
                started.append(replica)
            await wait_until(lambda: len([r for r in Replicas(redis_conn).live() if r.ready]) == len(names),
                             what="both replicas ready")
            return out

        yield start
        for replica in started:
            await replica.stop()
        for conn in conns:
            conn.close()


def register(conn: redis.Redis, run: str) -> None:
    Registry(conn).create_run(RunSpec(name=run, base_model="tiny"))


async def test_a_version_serves_only_once_every_ready_replica_holds_it(
    replicas: Callable[..., Awaitable[dict[str, Replica]]], redis_conn: redis.Redis, tmp_path: Path, tiny_model: Path,
) -> None:
    register(redis_conn, "both")
    reps = await replicas()
    a, b = reps["a"], reps["b"]
    await b.controller.stop()  # b stays ready by its heartbeat, but loads nothing for now

    store, registry, events = AdapterStore(tmp_path / "store"), Registry(redis_conn), EventStream(redis_conn)
    announce(events, store, publish(store, registry, tiny_model, "both", 1))
    await wait_until(lambda: a.table.loaded("both") == [1], what="a holds v1")
    await asyncio.sleep(1.0)  # well past a's own load: it waits for b
    assert a.table.serving("both") == 0 and a.table.held("both") == [1]
    assert not events_of(redis_conn, EventKind.ADAPTER_LOADED, "both")
    assert [e.data["replica"] for e in events_of(redis_conn, EventKind.ADAPTER_HELD, "both")] == ["replica-a"]

    b_starts = time.time()
    b.controller.start()  # b reconciles, loads v1: now both hold it
    await wait_until(lambda: a.table.serving("both") == 1 and b.table.serving("both") == 1, what="both serve v1")
    await wait_until(lambda: len(events_of(redis_conn, EventKind.ADAPTER_LOADED, "both")) == 2,
                     what="both announce v1")  # a replica serves, then appends its adapter_loaded
    loaded = events_of(redis_conn, EventKind.ADAPTER_LOADED, "both")
    assert sorted(e.data["replica"] for e in loaded) == ["replica-a", "replica-b"]
    # a serves once b's heartbeat says it holds v1; b's adapter_held event may be appended a moment
    # later, so a's serving is timed against b's start, not against that event
    assert [e.data["replica"] for e in events_of(redis_conn, EventKind.ADAPTER_HELD, "both")].count("replica-b") >= 1
    a_serves = next(e for e in loaded if e.data["replica"] == "replica-a")
    assert a_serves.ts >= b_starts and a_serves.data["stages_ms"]["agree"] >= 1000
    assert "without" not in a_serves.data  # it waited for b

    # both running: each holds v2, then both serve it
    announce(events, store, publish(store, registry, tiny_model, "both", 2))
    await wait_until(lambda: a.table.serving("both") == 2 and b.table.serving("both") == 2, what="both serve v2")
    assert {e.data["replica"] for e in events_of(redis_conn, EventKind.ADAPTER_HELD, "both") if e.version == 2} \
        == {"replica-a", "replica-b"}
    assert a.controller.agreement.in_rotation and b.controller.agreement.in_rotation


async def test_a_version_served_after_agree_s_names_the_replicas_it_did_not_wait_for(
    replicas: Callable[..., Awaitable[dict[str, Replica]]], redis_conn: redis.Redis, tmp_path: Path, tiny_model: Path,
) -> None:
    register(redis_conn, "late")
    reps = await replicas(agree_s=1.0)
    a, b = reps["a"], reps["b"]
    await b.controller.stop()  # b stays ready by its heartbeat, but loads nothing
    store = AdapterStore(tmp_path / "store")
    announce(EventStream(redis_conn), store, publish(store, Registry(redis_conn), tiny_model, "late", 1, rank=4))
    await wait_until(lambda: a.table.serving("late") == 1, what="a serves v1 without b")
    await wait_until(lambda: bool(events_of(redis_conn, EventKind.ADAPTER_LOADED, "late")),
                     what="a announces v1")  # a replica serves, then appends its adapter_loaded
    [loaded] = events_of(redis_conn, EventKind.ADAPTER_LOADED, "late")
    assert loaded.data["replica"] == "replica-a" and loaded.data["without"] == ["replica-b"]


async def test_a_replica_that_refuses_a_version_leaves_rotation_and_does_not_hold_the_run_back(
    replicas: Callable[..., Awaitable[dict[str, Replica]]], redis_conn: redis.Redis, tmp_path: Path, tiny_model: Path,
) -> None:
    register(redis_conn, "ranked")
    reps = await replicas(agree_s=600.0)  # only b's refusal can let a serve within the test
    a, b = reps["a"], reps["b"]
    store = AdapterStore(tmp_path / "store")
    manifest = publish(store, Registry(redis_conn), tiny_model, "ranked", 1, rank=8)  # above b's max_lora_rank 4
    announce(EventStream(redis_conn), store, manifest)

    await wait_until(lambda: a.table.serving("ranked") == 1, what="a serves v1 without b")
    rejected = events_of(redis_conn, EventKind.ADAPTER_REJECTED, "ranked")
    assert [e.data["replica"] for e in rejected] == ["replica-b"] and "max_lora_rank 4" in rejected[0].data["message"]
    await wait_until(lambda: not b.controller.agreement.in_rotation, what="b out of rotation")
    assert "replica-a serves ranked v1" in b.controller.agreement.behind["ranked"]
    await wait_until(lambda: [r.id for r in Replicas(redis_conn).live() if r.ready] == ["replica-a"],
                     what="b's heartbeat says not ready")
    assert b.table.serving("ranked") == 0  # b never serves what it does not hold


async def test_a_forged_heartbeat_claiming_an_unregistered_version_takes_no_replica_out_of_rotation(
    replicas: Callable[..., Awaitable[dict[str, Replica]]], redis_conn: redis.Redis, tmp_path: Path, tiny_model: Path,
) -> None:
    register(redis_conn, "rep")
    reps = await replicas(agree_s=1.0)
    store = AdapterStore(tmp_path / "store")
    announce(EventStream(redis_conn), store, publish(store, Registry(redis_conn), tiny_model, "rep", 1, rank=4))
    await wait_until(lambda: all(r.table.serving("rep") == 1 for r in reps.values()), what="both serve v1")
    ghost = ReplicaState(id="ghost-2", url="http://ghost-2:8000", ready=True,
                         runs={"rep": RunHolding(serving=52, loaded=[52])}, started_at=time.time())
    Replicas(redis_conn).beat(ghost, ttl_s=60)
    for replica in reps.values():
        await replica.controller.advance()
    assert all(r.controller.agreement.in_rotation for r in reps.values()), [r.controller.agreement.behind
                                                                           for r in reps.values()]
    assert all(r.controller.metrics.ignored_claims._value.get() == 1 for r in reps.values())
    # a claim of a registered version this replica does not hold still takes it out, as before
    manifest = publish(store, Registry(redis_conn), tiny_model, "rep", 2, rank=4)  # registered, never announced
    Replicas(redis_conn).beat(ghost.model_copy(update={"runs": {"rep": RunHolding(serving=manifest.version,
                                                                                  loaded=[2])}}), ttl_s=60)
    await reps["a"].controller.advance()
    assert "replica ghost-2 serves rep v2" in reps["a"].controller.agreement.behind["rep"]


def group() -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[
        Trajectory(prompt_ids=[1, 2], completion_ids=[3], rollout_logprobs=[-0.5], reward=r) for r in (0.0, 1.0)
    ])


def beat(conn: redis.Redis, replica: str, *, ready: bool = True, serving: int = 0) -> None:
    Replicas(conn).beat(ReplicaState(id=replica, url=f"http://{replica}:8000", ready=ready,
                                     runs={"waits": RunHolding(serving=serving, loaded=[])},
                                     started_at=time.time()), ttl_s=60)


def test_train_returns_once_every_ready_replica_serves_its_version(redis_conn: redis.Redis,
                                                                   client_conn: redis.Redis) -> None:
    register(redis_conn, "waits")
    run = Client("http://127.0.0.1:9", conn=client_conn).run("waits")
    events = EventStream(redis_conn)
    for replica in ("r1", "r2"):
        beat(redis_conn, replica)
    beat(redis_conn, "r3", ready=False)  # out of rotation: not waited for

    handle = run.train([group()], wait=False)
    events.append(Event(kind=EventKind.ADAPTER_READY, run="waits", version=1, job_id=handle.job_id,
                        data={"step": 1, "parent": 0}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="waits", version=1, job_id=handle.job_id,
                        data={"replica": "r1"}))
    with pytest.raises(TrainTimeout):
        handle.result(timeout_s=1.5)  # r2 does not serve v1 yet
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="waits", version=1, job_id=handle.job_id,
                        data={"replica": "r2"}))
    assert handle.result(timeout_s=10).version == 1


def test_a_ready_replica_that_says_nothing_of_the_version_holds_train_back_only_briefly(
        redis_conn: redis.Redis, client_conn: redis.Redis) -> None:
    """A forged "ready" heartbeat (or a replica stuck before loading) is waited for `silent_replica_s`
    after the first replica serves, not until train()'s timeout; one that holds the version is
    waited for as before."""
    from tandem.settings import ClientSettings

    register(redis_conn, "waits")
    settings = ClientSettings(gateway_url="http://127.0.0.1:9", silent_replica_s=1.0)
    run = Client(conn=client_conn, settings=settings).run("waits")
    events = EventStream(redis_conn)
    for replica in ("r1", "ghost", "slow"):
        beat(redis_conn, replica)
    handle = run.train([group()], wait=False)
    events.append(Event(kind=EventKind.ADAPTER_READY, run="waits", version=1, job_id=handle.job_id,
                        data={"step": 1, "parent": 0}))
    events.append(Event(kind=EventKind.ADAPTER_HELD, run="waits", version=1, data={"replica": "slow"}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="waits", version=1, job_id=handle.job_id,
                        data={"replica": "r1"}))
    with pytest.raises(TrainTimeout):
        handle.result(timeout_s=2.5)  # the ghost is let go after 1 s, "slow" holds v1: still waited for
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="waits", version=1, job_id=handle.job_id,
                        data={"replica": "slow"}))
    started = time.monotonic()
    assert handle.result(timeout_s=30).version == 1
    assert time.monotonic() - started < 5  # never the ghost's doing


def test_a_replica_the_serving_replicas_left_behind_is_not_waited_for(redis_conn: redis.Redis,
                                                                      client_conn: redis.Redis) -> None:
    """A replica that an `adapter_loaded` names in `without` (served after `replica.agree_s`
    without it) is not waited for from then on, not `silent_replica_s` later, unless it said
    it holds the version."""
    register(redis_conn, "waits")
    run = Client("http://127.0.0.1:9", conn=client_conn).run("waits")  # silent_replica_s: 15 s
    events = EventStream(redis_conn)
    for replica in ("r1", "r2", "ghost", "slow"):
        beat(redis_conn, replica)
    handle = run.train([group()], wait=False)
    events.append(Event(kind=EventKind.ADAPTER_READY, run="waits", version=1, job_id=handle.job_id,
                        data={"step": 1, "parent": 0}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="waits", version=1, job_id=handle.job_id,
                        data={"replica": "r1", "without": ["ghost", "slow"]}))
    events.append(Event(kind=EventKind.ADAPTER_HELD, run="waits", version=1, data={"replica": "slow"}))
    with pytest.raises(TrainTimeout):
        handle.result(timeout_s=1.5)  # r2 serves nothing yet; "slow" holds v1 since: waited for
    for replica in ("r2", "slow"):
        events.append(Event(kind=EventKind.ADAPTER_LOADED, run="waits", version=1, job_id=handle.job_id,
                            data={"replica": replica, "without": ["ghost"]}))
    started = time.monotonic()
    assert handle.result(timeout_s=5).version == 1  # the ghost, never heard of, is not waited for
    assert time.monotonic() - started < 3


def test_train_fails_only_when_every_ready_replica_refused_its_version(redis_conn: redis.Redis,
                                                                       client_conn: redis.Redis) -> None:
    register(redis_conn, "waits")
    run = Client("http://127.0.0.1:9", conn=client_conn).run("waits")
    events = EventStream(redis_conn)
    for replica in ("r1", "r2"):
        beat(redis_conn, replica)

    one = run.train([group()], wait=False)  # refused by r2, served by r1: it serves
    events.append(Event(kind=EventKind.ADAPTER_READY, run="waits", version=1, job_id=one.job_id, data={"step": 1}))
    events.append(Event(kind=EventKind.ADAPTER_REJECTED, run="waits", version=1, job_id=one.job_id,
                        data={"replica": "r2", "message": "no room"}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="waits", version=1, job_id=one.job_id,
                        data={"replica": "r1"}))
    assert one.result(timeout_s=10).version == 1

    two = run.train([group()], wait=False)  # refused by both
    events.append(Event(kind=EventKind.ADAPTER_READY, run="waits", version=2, job_id=two.job_id, data={"step": 2}))
    for replica in ("r1", "r2"):
        events.append(Event(kind=EventKind.ADAPTER_REJECTED, run="waits", version=2, job_id=two.job_id,
                            data={"replica": replica, "message": f"{replica} says no"}))
    with pytest.raises(TrainFailed, match="replica r1: r1 says no; replica r2: r2 says no"):
        two.result(timeout_s=10)
