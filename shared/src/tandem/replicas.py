"""Inference replicas: which ones live, and what each holds, from their heartbeats in Redis.

Every inference service is a replica with an id (`replica.id`, by default the host name).
Every `replica.heartbeat_s` it writes its state -- the URL its gateway answers on, whether it
is ready, and per run the version it serves and the versions it has loaded -- to
`tandem:replica:<id>` with an expiry of `replica.ttl_s`, and adds its id to `tandem:replicas`.
A replica that stops deletes its key; one that dies drops out when the expiry passes. Readers
(`tandem status`, the client, other replicas) take `Replicas.live()` as the truth: an id in the
set whose key expired is removed there (by the replicas: the client's Redis user only reads, so
its `Replicas(conn, prune=False)` leaves them), and a key that does not parse is skipped and logged.

Every public method raises `BackendUnavailable`, naming the Redis URL, when Redis fails.
"""

from __future__ import annotations

import logging
import re
import time

import redis
from pydantic import BaseModel, Field, ValidationError

from tandem import keys
from tandem.connection import text, translated

log = logging.getLogger(__name__)

#: What a replica id may be: it names a Redis key, a log field and a response header.
REPLICA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class RunHolding(BaseModel):
    """One run on one replica."""

    serving: int = Field(0, ge=0)
    """The version requests for the run get (0: the base model)."""
    loaded: list[int] = Field(default_factory=list)
    """Versions the replica's engine holds, oldest first."""


class ReplicaState(BaseModel):
    """What a replica says of itself in each heartbeat."""

    id: str = Field(pattern=REPLICA_ID.pattern)
    url: str
    """Where its gateway answers (what a router sends requests to)."""
    ready: bool
    """Its engine answers and its controller has reconciled (its /ready)."""
    runs: dict[str, RunHolding] = Field(default_factory=dict)
    started_at: float
    beat_at: float = Field(default_factory=time.time)


class Replicas:
    """The heartbeats of the inference replicas sharing one Redis."""

    def __init__(self, conn: redis.Redis, *, prune: bool = True) -> None:
        self.conn = conn
        self.prune = prune
        """Whether `live()` removes the ids whose heartbeat expired (a writer's job: the client only reads)."""

    def beat(self, state: ReplicaState, ttl_s: float) -> None:
        """Write `state` with an expiry of `ttl_s` and list the replica."""
        key = keys.replica(state.id)
        with translated(self.conn, f"write the heartbeat of replica {state.id!r}"):
            pipe = self.conn.pipeline()
            pipe.set(key, state.model_dump_json(), px=max(1, int(ttl_s * 1000)))
            pipe.sadd(keys.REPLICAS, state.id)
            pipe.execute()

    def leave(self, replica_id: str) -> None:
        """Take a stopping replica out at once (a dead one drops out when its key expires)."""
        with translated(self.conn, f"remove the heartbeat of replica {replica_id!r}"):
            pipe = self.conn.pipeline()
            pipe.delete(keys.replica(replica_id))
            pipe.srem(keys.REPLICAS, replica_id)
            pipe.execute()

    def live(self) -> list[ReplicaState]:
        """The replicas whose heartbeat has not expired, by id."""
        with translated(self.conn, f"read the replicas ({keys.REPLICAS})"):
            ids = sorted(text(raw) for raw in self.conn.smembers(keys.REPLICAS))
            raws = self.conn.mget([keys.replica(i) for i in ids]) if ids else []
            gone = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
            if gone and self.prune:
                self.conn.srem(keys.REPLICAS, *gone)
        states = []
        for replica_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                continue
            try:
                state = ReplicaState.model_validate_json(raw)
            except ValidationError as exc:
                log.warning("replica %r: heartbeat %s does not parse (%s); left out",
                            replica_id, keys.replica(replica_id), exc.errors()[0]["msg"])
                continue
            if state.id == replica_id:
                states.append(state)
        return states
