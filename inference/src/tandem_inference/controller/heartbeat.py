"""This inference service's heartbeat as a replica (tandem.replicas).

Every `replica.heartbeat_s` it writes what a router or a client needs to know of this replica:
the URL its gateway answers on, whether it is ready (the same test as its /ready: the engine
answers and the controller has reconciled), and per run the version it serves and the versions
its engine holds, from the routing table. When the service stops it takes the replica out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis

from tandem.errors import BackendUnavailable
from tandem.replicas import Replicas, ReplicaState, RunHolding
from tandem.settings import InferenceSettings
from tandem_inference.routing import RoutingTable

log = logging.getLogger(__name__)


class Heartbeat:
    """Writes this replica's state until stopped; `run` is one of the service's loops."""

    def __init__(self, settings: InferenceSettings, conn: redis.Redis, table: RoutingTable,
                 ready: Callable[[], Awaitable[bool]]) -> None:
        self.settings = settings.replica
        self.replicas = Replicas(conn)
        self.table = table
        self.ready = ready
        self.started_at = time.time()

    def state(self, ready: bool) -> ReplicaState:
        runs = {run: RunHolding(serving=self.table.serving(run), loaded=self.table.loaded(run))
                for run in self.table.runs()}
        assert self.settings.url is not None, "InferenceSettings fills replica.url"
        return ReplicaState(id=self.settings.id, url=self.settings.url, ready=ready, runs=runs,
                            started_at=self.started_at)

    async def beat(self) -> None:
        state = self.state(await self.ready())
        await asyncio.to_thread(self.replicas.beat, state, self.settings.ttl_s)

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.beat()
                except BackendUnavailable as exc:
                    log.warning("replica heartbeat not written (%s); trying again", exc)
                await asyncio.sleep(self.settings.heartbeat_s)
        finally:
            try:
                await asyncio.to_thread(self.replicas.leave, self.settings.id)
            except BackendUnavailable as exc:  # its key expires by itself
                log.warning("replica %s not removed from Redis (%s); it drops out in %.0f s",
                            self.settings.id, exc, self.settings.ttl_s)
