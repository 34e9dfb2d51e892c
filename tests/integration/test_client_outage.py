"""The client during a Redis outage, against a redis-server of the test's own that it stops and restarts.

A waiting `train()` rides out an outage shorter than its timeout; a call that needs Redis while it
is down fails with `BackendUnavailable` naming the Redis URL (never its password) and what to do;
no redis-py error reaches user code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers.redis_server import RedisServer
from redis.exceptions import AuthorizationError

from tandem import Client
from tandem.adapters import Manifest
from tandem.connection import call_until, redis_url, retryable
from tandem.errors import BackendUnavailable, TrainTimeout
from tandem.events import Cursor, Event, EventKind, EventStream
from tandem.lease import GpuLease
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.trajectories import Trajectory, TrajectoryGroup

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-pw"


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server with a password and an append-only file: a restart comes back with its data."""
    server = RedisServer(tmp_path, password=PASSWORD).start()
    yield server
    server.stop()


def group() -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[
        Trajectory(prompt_ids=[1, 2], completion_ids=[3], rollout_logprobs=[-0.5], reward=r) for r in (0.0, 1.0)
    ])


def client_for(server: RedisServer) -> Client:
    """A client whose run exists (registered as the trainer side would see it); no gateway is needed."""
    client = Client("http://127.0.0.1:9", server.url)
    Registry(client.conn).create_run(RunSpec(name="r", base_model="tiny"))
    return client


def served(conn: redis.Redis, job_id: str, *, ready: bool = True, loaded: bool = True) -> None:
    """What the trainer and then the inference side append when the job's version serves."""
    events = EventStream(conn)
    if ready:
        events.append(Event(kind=EventKind.ADAPTER_READY, run="r", version=1, job_id=job_id,
                            data={"step": 1, "parent": 0, "metrics": {"loss": 0.5}}))
    if loaded:
        events.append(Event(kind=EventKind.ADAPTER_LOADED, run="r", version=1, job_id=job_id, data={}))


def waiting(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `call` in a thread; its result or error lands in the returned dict."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = call()
        except Exception as exc:  # noqa: BLE001 - handed to the test's assertions
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def test_a_waiting_result_rides_out_a_redis_restart(own_redis: RedisServer) -> None:
    client = client_for(own_redis)
    handle = client.run("r").train([group()], wait=False)
    served(client.conn, handle.job_id, loaded=False)
    thread, out = waiting(lambda: handle.result(timeout_s=60))
    time.sleep(0.5)  # the handle is blocked reading the stream
    own_redis.stop()
    time.sleep(2)
    assert thread.is_alive(), out  # still waiting, not failed
    own_redis.start()
    with redis.Redis.from_url(own_redis.url) as conn:
        served(conn, handle.job_id, ready=False)
    thread.join(30)
    assert "error" not in out, out
    assert out["result"].version == 1 and out["result"].metrics["loss"] == 0.5
    client.close()


def test_a_sync_train_rides_out_a_redis_restart(own_redis: RedisServer) -> None:
    client = client_for(own_redis)
    run = client.run("r")
    thread, out = waiting(lambda: run.train([group()], timeout_s=60))
    with redis.Redis.from_url(own_redis.url) as conn:  # the job is on the queue: find its id
        deadline = time.monotonic() + 10
        while not (job_ids := [j.decode() for j in conn.lrange("rq:queue:tandem-train", 0, -1)]):
            assert time.monotonic() < deadline, "the job was never enqueued"
            time.sleep(0.02)
    time.sleep(0.5)
    own_redis.stop()
    time.sleep(2)
    own_redis.start()
    with redis.Redis.from_url(own_redis.url) as conn:
        served(conn, job_ids[0])
    thread.join(30)
    assert "error" not in out, out
    assert out["result"].job_id == job_ids[0] and run.status()["pending_jobs"] == []
    client.close()


def test_train_while_redis_is_down_names_the_url_without_its_password(own_redis: RedisServer) -> None:
    client = client_for(own_redis)
    run = client.run("r")
    own_redis.stop()
    with pytest.raises(BackendUnavailable) as info:
        run.train([group()], timeout_s=5)
    message = str(info.value)
    assert f"redis://127.0.0.1:{own_redis.port}/0" in message and PASSWORD not in message
    assert "TANDEM_REDIS__URL" in message and "start Redis" in message
    assert message.startswith("train() submitted nothing for run 'r'") and "submit the same groups again" in message
    client.close()


def test_an_outage_longer_than_the_timeout_keeps_the_job_pending(own_redis: RedisServer) -> None:
    client = client_for(own_redis)
    run = client.run("r")
    handle = run.train([group()], wait=False)
    own_redis.stop()
    with pytest.raises(BackendUnavailable) as info:
        run.wait_all(timeout_s=1.5)
    assert f"127.0.0.1:{own_redis.port}" in str(info.value) and PASSWORD not in str(info.value)
    assert handle.job_id in str(info.value) and "wait_all" in str(info.value)
    own_redis.start()
    with redis.Redis.from_url(own_redis.url) as conn:
        served(conn, handle.job_id)
    assert [r.job_id for r in run.wait_all(timeout_s=30)] == [handle.job_id]
    client.close()


def test_no_event_and_redis_up_is_still_a_timeout(own_redis: RedisServer) -> None:
    client = client_for(own_redis)
    handle = client.run("r").train([group()], wait=False)
    with pytest.raises(TrainTimeout):
        handle.result(timeout_s=0.5)
    client.close()


def test_every_registry_event_cursor_and_lease_call_during_an_outage_is_backend_unavailable(
    own_redis: RedisServer,
) -> None:
    conn = redis.Redis.from_url(own_redis.url)
    reg, lease, events, cursor = Registry(conn), GpuLease(conn, ttl_s=5, holder="t"), EventStream(conn), Cursor(conn, "c")
    manifest = Manifest(run="r", version=1, parent=0, step=1, job_id="j", base_model="tiny", lora_rank=4)
    own_redis.stop()
    calls: dict[str, Callable[[], Any]] = {
        "create_run": lambda: reg.create_run(RunSpec(name="r", base_model="tiny")),
        "get_run": lambda: reg.get_run("r"),
        "list_runs": reg.list_runs,
        "next_step": lambda: reg.next_step("r"),
        "register_version": lambda: reg.register_version(manifest),
        "latest_version": lambda: reg.latest_version("r"),
        "manifest": lambda: reg.manifest("r", 1),
        "manifests": lambda: reg.manifests("r"),
        "version_of_job": lambda: reg.version_of_job("r", "j"),
        "set_serving": lambda: reg.set_serving("r", 1),
        "serving": lambda: reg.serving("r"),
        "set_loaded": lambda: reg.set_loaded("r", [1]),
        "loaded": lambda: reg.loaded("r"),
        "next_load_attempt": lambda: reg.next_load_attempt("r", 1),
        "lease.request": lease.request,
        "lease.acquire": lambda: lease.acquire(wait_s=0.2),
        "lease.renew": lease.renew,
        "lease.release": lease.release,
        "lease.state": lease.state,
        "lease.grant": lease.grant,
        "events.append": lambda: events.append(Event(kind=EventKind.ADAPTER_READY, run="r", version=1)),
        "events.last_id": events.last_id,
        "events.read": lambda: events.read("0-0"),
        "events.history": events.history,
        "events.since": lambda: next(events.since(0.0)),
        "events.follow": lambda: next(events.follow("0-0", deadline=time.monotonic() + 5)),
        "cursor.get": cursor.get,
        "cursor.commit": lambda: cursor.commit("1-0"),
    }
    for name, call in calls.items():
        with pytest.raises(BackendUnavailable) as info:
            call()
        message = str(info.value)
        assert f"redis://127.0.0.1:{own_redis.port}/0" in message, (name, message)
        assert PASSWORD not in message and "TANDEM_REDIS__URL" in message, (name, message)
    conn.close()


def test_what_is_retried_is_decided_by_one_predicate() -> None:
    def wrapped(exc: Exception) -> BackendUnavailable:
        try:
            raise BackendUnavailable("x") from exc
        except BackendUnavailable as outer:
            return outer

    for exc in (redis.ConnectionError("refused"), redis.TimeoutError("slow"), redis.BusyLoadingError("loading")):
        assert retryable(exc) and retryable(wrapped(exc)), exc
    for exc in (redis.AuthenticationError("wrong password"), AuthorizationError("no"),
                redis.ResponseError("WRONGTYPE"), ValueError("x"), BackendUnavailable("gateway down")):
        assert not retryable(exc) and not retryable(wrapped(exc)), exc


def test_call_until_retries_until_it_succeeds_and_gives_up_at_the_deadline() -> None:
    tries: list[float] = []

    def flaky() -> str:
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise redis.ConnectionError("refused")
        return "ok"

    assert call_until(time.monotonic() + 10, flaky, what="test") == "ok" and len(tries) == 3
    with pytest.raises(redis.ConnectionError):
        call_until(time.monotonic() + 0.3, lambda: (_ for _ in ()).throw(redis.ConnectionError("down")), what="test")
    with pytest.raises(redis.AuthenticationError):  # not retryable: raised at once
        call_until(time.monotonic() + 60, lambda: (_ for _ in ()).throw(redis.AuthenticationError("pw")), what="t")


def test_the_url_in_messages_never_carries_credentials() -> None:
    assert redis_url(redis.Redis.from_url("redis://user:pw@example:6390/2")) == "redis://example:6390/2"
    assert redis_url(redis.Redis.from_url("rediss://:pw@example:6390/0")) == "rediss://example:6390/0"
    assert redis_url(redis.Redis.from_url("unix:///run/redis.sock?db=3")) == "unix:///run/redis.sock?db=3"
