"""Shared mode, the trainer side: hold the GPU lease for the compute part of a job.

The inference side (tandem_inference.controller.gpu_sharing) drains and releases its GPU memory when it
sees the request, then grants; the trainer computes only after the grant, renews the lease
while it works (so a dead trainer's lease expires within one TTL), empties its CUDA cache
and gives the lease back, upon which inference resumes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from tandem.lease import GpuLease
from tandem.settings import GpuSettings

log = logging.getLogger(__name__)


class SharedGpu:
    """The trainer's hold on the one GPU of shared mode, through the GPU lease in Redis."""

    def __init__(self, conn: redis.Redis, settings: GpuSettings, *, holder: str | None = None) -> None:
        self.settings = settings
        self.lease = GpuLease(conn, ttl_s=settings.lease_ttl_s, holder=holder)

    @contextmanager
    def held(self) -> Iterator[float]:
        """Hold the GPU for the block; yields the seconds spent waiting for it."""
        t0 = time.perf_counter()
        waited = self.lease.acquire(wait_s=self.settings.lease_wait_s)
        log.info("gpu.lease.granted waited_s=%.3f", waited)
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(stop,), name="gpu-lease-renew", daemon=True)
        renewer.start()
        try:
            yield waited
        finally:
            stop.set()
            renewer.join()
            _free_cuda_cache()
            self.lease.release()
            log.info("gpu.lease.released held_s=%.3f", time.perf_counter() - t0)

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(self.settings.lease_ttl_s / 3):
            if not self.lease.renew():
                log.error("gpu lease lost while training (expired?); inference may resume under us")


def _free_cuda_cache() -> None:
    """Give cached CUDA blocks back so the engine can take its memory again."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
