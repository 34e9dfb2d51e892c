"""Shared mode, the inference side: lend the one GPU to the trainer and take it back.

The trainer asks for the GPU through the lease in Redis (`tandem.lease`). This loop sees the
request, stops admitting new generation requests (they wait in the gateway, nothing is
dropped), lets the ones in flight finish, asks the engine to release its GPU memory
(`Engine.release_memory`; SGLang needs `--enable-memory-saver` for it), and grants the
lease. When the lease ends — released by the trainer, or expired because the trainer died —
it resumes the engine's memory and opens admission again. No restart on either side. With
`gpus.release_tags` empty the engine frees and resumes nothing: only the drain and the lease
remain, for a trainer that fits beside the engine's memory.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis

from tandem.lease import INFERENCE, GpuLease
from tandem.settings import InferenceSettings
from tandem_inference.engines.base import Engine
from tandem_inference.routing import RoutingTable

log = logging.getLogger(__name__)


class Admission:
    """A gate in front of generation: open normally, closed while the GPU is lent out."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        """Return when requests may reach the engine."""
        await self._open.wait()


class GpuSharing:
    """Follow the GPU lease: drain + release when the trainer asks, resume when it is done."""

    def __init__(
        self,
        settings: InferenceSettings,
        conn: redis.Redis,
        engine: Engine,
        table: RoutingTable,
        admission: Admission,
        *,
        poll_s: float = 0.5,
    ) -> None:
        self.lease = GpuLease(conn, ttl_s=settings.gpus.lease_ttl_s, holder="inference")
        self.tags = list(settings.gpus.release_tags)
        self.engine = engine
        self.table = table
        self.admission = admission
        self.poll_s = poll_s
        self.released = False
        self.handovers: list[dict[str, float]] = []
        """Per handover: drain_ms, release_ms, lent_ms, resume_ms (the newest last)."""
        self._current: dict[str, float] = {}

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
                # the trainer rings on request and release: no polling delay on either
                await asyncio.to_thread(self.lease.wait_bell, INFERENCE, self.poll_s)
            except Exception:  # noqa: BLE001 - logged; the GPU must keep changing hands
                log.exception("gpu sharing step failed; trying again")
                await asyncio.sleep(1.0)

    async def tick(self) -> None:
        state = await asyncio.to_thread(self.lease.state)
        if state is not None and not self.released:
            await self._lend()
        elif state is None and self.released:
            await self._take_back()

    async def _lend(self) -> None:
        t0 = time.monotonic()
        self.admission.close()
        while self.table.in_flight_total() > 0:
            await asyncio.sleep(0.005)
        t1 = time.monotonic()
        if self.tags:  # none: the engine keeps its memory and only stops serving while the trainer steps
            await self.engine.release_memory(self.tags)
        t2 = time.monotonic()
        self.released = True
        await asyncio.to_thread(self.lease.grant)
        self._current = {"drain_ms": (t1 - t0) * 1000, "release_ms": (t2 - t1) * 1000, "lent_at": t2}
        log.info("gpu lent to the trainer: drain_ms=%.1f release_ms=%.1f",
                 self._current["drain_ms"], self._current["release_ms"])

    async def _take_back(self) -> None:
        t0 = time.monotonic()
        if self.tags:
            await self.engine.resume_memory(self.tags)
        self.released = False
        self.admission.open()
        done = time.monotonic()
        record = {**self._current, "lent_ms": (t0 - self._current.pop("lent_at", t0)) * 1000,
                  "resume_ms": (done - t0) * 1000}
        record.pop("lent_at", None)
        self.handovers.append(record)
        del self.handovers[:-1000]
        log.info("gpu back: lent_ms=%.1f resume_ms=%.1f", record["lent_ms"], record["resume_ms"])
