"""Publishing a trained version, and finding again what a job already published.

A version is published in three steps: its files are renamed into the store (the store makes
that atomic), it is registered in Redis, and `adapter_ready` is appended to the event stream.
A crash can cut that short between any two, so a job that runs again looks for what its first
attempt did before it trains: a version registered under its job id is returned again (and
announced, if the crash came before the announcement); a version that reached the store but
not the registry is adopted. That makes a retried job publish at most one version.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

from tandem.adapters import ADAPTER_DIR, AdapterStore, Manifest
from tandem.errors import AdapterRejected
from tandem.events import Event, EventKind, EventStream
from tandem.jobs import TrainJob, TrainResult
from tandem.registry import Registry
from tandem_trainer import failpoints
from tandem_trainer.errors import CheckpointError

log = logging.getLogger(__name__)

#: How far the trainer's clock may run ahead of Redis's, in seconds, when looking for an
#: announcement in the stream (entry ids are Redis's milliseconds).
ANNOUNCE_SKEW_S = 60.0



def result_of(manifest: Manifest, *, reused: bool, train_s: float = 0.0,
              published_at: float | None = None) -> TrainResult:
    """The job's result, read from the manifest of the version it published."""
    return TrainResult(
        job_id=manifest.job_id, run=manifest.run, step=manifest.step, version=manifest.version,
        parent=manifest.parent, metrics=manifest.metrics, train_s=train_s,
        published_at=manifest.created_at if published_at is None else published_at, reused=reused,
    )


class Publisher:
    """Publishes versions to one store, registry and event stream."""

    def __init__(self, conn: redis.Redis, store: AdapterStore) -> None:
        self.conn, self.store = conn, store
        self.registry, self.events = Registry(conn), EventStream(conn)

    # publishing ---------------------------------------------------------------
    def publish(self, job: TrainJob, manifest: Manifest, write_adapter: Callable[[Path], None], *,
                train_s: float, stepped_at: float) -> TrainResult:
        """Stage the version, let `write_adapter` fill its `adapter/`, rename it into place, announce it."""
        removed = self.store.remove_stale_staging(job.run)
        if removed:
            log.info("store.staging.cleaned run=%s removed=%d", job.run, removed)
        t0 = time.perf_counter()
        with self.store.staging(job.run, manifest.version) as staged:
            failpoints.hit("staging_created")
            write_adapter(staged / ADAPTER_DIR)
            failpoints.hit("weights_written")
            t1 = time.perf_counter()
            manifest = self.store.publish(staged, manifest)
        failpoints.hit("after_rename")
        published_at = time.time()
        t2 = time.perf_counter()
        self.announce(manifest, published_at=published_at, stepped_at=stepped_at)
        failpoints.hit("after_announce")
        log.info("publish run=%s version=%d save_ms=%.1f checksum_fsync_rename_ms=%.1f announce_ms=%.1f",
                 job.run, manifest.version, (t1 - t0) * 1000, (t2 - t1) * 1000, (time.perf_counter() - t2) * 1000)
        return result_of(manifest, reused=False, train_s=train_s, published_at=published_at)

    def announce(self, manifest: Manifest, *, published_at: float, stepped_at: float | None = None) -> None:
        """Register the version and append `adapter_ready`.

        `stepped_at` (the last optimizer step) and `published_at` (the version renamed into
        place) let anyone reading the stream time each stage of the sync path.
        """
        self.registry.register_version(manifest)
        failpoints.hit("after_register")
        self._append_ready(manifest, published_at=published_at, stepped_at=stepped_at)

    def _append_ready(self, manifest: Manifest, *, published_at: float, stepped_at: float | None = None) -> None:
        adapter = self.store.adapter_dir(manifest.run, manifest.version)
        self.events.append(Event(
            kind=EventKind.ADAPTER_READY, run=manifest.run, version=manifest.version, job_id=manifest.job_id,
            data={
                "path": str(adapter.relative_to(self.store.root)),
                "step": manifest.step, "parent": manifest.parent, "metrics": manifest.metrics,
                "published_at": published_at, "stepped_at": stepped_at,
            },
        ))

    # finding what a job already did ---------------------------------------------
    def reused(self, job: TrainJob) -> TrainResult | None:
        """The version this job already published, announced (again, if a crash cut that off)."""
        version = self.registry.version_of_job(job.run, job.job_id)
        manifest = self.registry.manifest(job.run, version) if version is not None else None
        if manifest is None:
            return None
        if not self.announced(manifest):
            log.warning("announce.resumed run=%s version=%d job_id=%s: registered but never announced",
                        manifest.run, manifest.version, manifest.job_id)
            self._append_ready(manifest, published_at=manifest.created_at)
        return result_of(manifest, reused=True)

    def announced(self, manifest: Manifest) -> bool:
        """Whether the stream holds this version's `adapter_ready`.

        It was appended after the version's publish, so only entries since then (less a margin
        for clock skew between the trainer and Redis) are read. A stream trimmed past it reads
        as not announced, and the version is announced again: harmless to consumers.
        """
        return any(
            event.kind == EventKind.ADAPTER_READY and event.run == manifest.run and event.version == manifest.version
            for event in self.events.since(manifest.created_at - ANNOUNCE_SKEW_S)
        )

    def adopt_orphans(self, job: TrainJob) -> TrainResult | None:
        """Register versions that reached the store but not the registry; ours is returned.

        Only a crash between rename and register leaves such a version, and it always sits
        above the newest registered one. Adopting every one in order (whoever's job made it)
        keeps the version chain linear, and the job that made it finds it on retry.
        """
        result = self.reused(job)
        if result is not None:
            return result
        latest = self.registry.latest_version(job.run)
        for version in self.store.versions(job.run):
            if version <= latest:
                continue
            try:
                manifest = self.store.verify(job.run, version)
            except AdapterRejected as exc:
                self._move_aside(job.run, version)
                log.warning("orphan %s v%d failed verification (%s); moved aside", job.run, version, exc)
                break
            self.announce(manifest, published_at=time.time())
            log.info("orphan.adopted run=%s version=%d job_id=%s", job.run, version, manifest.job_id)
        return self.reused(job)

    def _move_aside(self, run: str, version: int) -> None:
        vdir = self.store.version_dir(run, version)
        try:
            vdir.rename(vdir.with_name(f".tmp-rejected-{vdir.name}-{uuid.uuid4().hex[:8]}"))
        except OSError as exc:
            raise CheckpointError(f"{run} v{version} failed verification and cannot be moved aside "
                                  f"({exc}); remove {vdir} by hand") from exc
