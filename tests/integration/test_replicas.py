"""Replica heartbeats in a real Redis: what `Replicas.live()` shows, and what it leaves out."""

from __future__ import annotations

import time

import pytest

from tandem import keys
from tandem.replicas import Replicas, ReplicaState, RunHolding

pytestmark = pytest.mark.integration


def state(replica_id: str, **runs: RunHolding) -> ReplicaState:
    return ReplicaState(id=replica_id, url=f"http://{replica_id}:8000", ready=True, runs=runs, started_at=time.time())


def test_live_replicas_with_what_each_holds(redis_conn) -> None:
    replicas = Replicas(redis_conn)
    replicas.beat(state("b", digits=RunHolding(serving=3, loaded=[2, 3])), ttl_s=30)
    replicas.beat(state("a"), ttl_s=30)
    live = replicas.live()
    assert [r.id for r in live] == ["a", "b"]
    assert live[1].runs["digits"] == RunHolding(serving=3, loaded=[2, 3])
    replicas.leave("b")
    assert [r.id for r in replicas.live()] == ["a"]
    assert redis_conn.smembers(keys.REPLICAS) == {b"a"}


def test_a_replica_whose_heartbeat_expired_drops_out(redis_conn) -> None:
    replicas = Replicas(redis_conn)
    replicas.beat(state("gone"), ttl_s=0.05)
    replicas.beat(state("here"), ttl_s=30)
    time.sleep(0.2)
    assert [r.id for r in replicas.live()] == ["here"]
    assert redis_conn.smembers(keys.REPLICAS) == {b"here"}  # the dead one's id is cleaned up too


def test_a_client_reads_the_live_replicas_and_leaves_the_dead_ones_ids_to_the_replicas(redis_conn, client_conn) -> None:
    """The client's Redis user only reads heartbeats (tandem.acl): it skips an expired one without removing it."""
    replicas = Replicas(redis_conn)
    replicas.beat(state("gone"), ttl_s=0.05)
    replicas.beat(state("here"), ttl_s=30)
    time.sleep(0.2)
    assert [r.id for r in Replicas(client_conn, prune=False).live()] == ["here"]
    assert redis_conn.smembers(keys.REPLICAS) == {b"gone", b"here"}
    assert [r.id for r in replicas.live()] == ["here"]  # a replica's read removes it
    assert redis_conn.smembers(keys.REPLICAS) == {b"here"}


@pytest.mark.parametrize("raw", [b"not json", b'{"id": "other", "url": "u", "ready": true, "started_at": 1}',
                                 b'{"id": "odd", "url": "u", "ready": "maybe", "started_at": 1}', b"[]"])
def test_a_heartbeat_that_does_not_parse_or_names_another_replica_is_left_out(redis_conn, raw: bytes) -> None:
    replicas = Replicas(redis_conn)
    replicas.beat(state("good"), ttl_s=30)
    redis_conn.sadd(keys.REPLICAS, "odd")
    redis_conn.set(keys.replica("odd"), raw)
    assert [r.id for r in replicas.live()] == ["good"]
