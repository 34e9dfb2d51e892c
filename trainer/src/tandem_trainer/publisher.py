"""Publishing a trained version, and finding again what a job already published.

A version is published in four steps: its files are written and renamed into the store (the
store makes that atomic), it is registered in Redis, `adapter_ready` is appended to the event
stream, and then its files are fsynced. The fsync comes after the announcement, off the path
to serving: until it is done a power loss can tear files that are already visible, and their
checksums, checked by the controller beside every load and by the trainer before it resumes
from a version, refuse them (docs/architecture.md, "Checksums and durability"). A job returns only after the
fsync, so a finished job's version is on disk.
A crash can cut that short between any two, so a job that runs again looks for what its first
attempt did before it trains: a version registered under its job id is returned again (and
announced, if the crash came before the announcement); a version that reached the store but
not the registry is adopted. That makes a retried job publish at most one version.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid

import redis
from pydantic import JsonValue

from tandem.adapters import ADAPTER_DIR, AdapterStore, Manifest
from tandem.errors import AdapterRejected
from tandem.events import Event, EventKind, EventStream
from tandem.jobs import TrainJob, TrainResult, groups_digest
from tandem.registry import Registry
from tandem.tinker_jobs import LoadStateJob, OptimStepJob
from tandem_trainer import failpoints
from tandem_trainer.adapter_files import StagedAdapter
from tandem_trainer.backends.base import ADAPTER_WEIGHTS
from tandem_trainer.blanks import Blanks
from tandem_trainer.errors import CheckpointError, JobRejected

log = logging.getLogger(__name__)

#: How far the trainer's clock may run ahead of Redis's, in seconds, when looking for an
#: announcement in the stream (entry ids are Redis's milliseconds).
ANNOUNCE_SKEW_S = 60.0


#: A job of a kind that publishes versions: a train job, Tinker's `optim_step` and `load_state`.
NamedJob = TrainJob | OptimStepJob | LoadStateJob


def job_digest(job: NamedJob) -> str:
    """What makes a job the job it is, for its manifest: a train job's groups (`groups_digest`),
    another kind's whole payload but its id, timing and sequence number."""
    if isinstance(job, TrainJob):
        return groups_digest(job)
    return hashlib.sha256(job.model_dump_json(exclude={"job_id", "timeout_s", "submitted_at", "seq"}).encode()
                          ).hexdigest()


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

    def __init__(self, conn: redis.Redis, store: AdapterStore, *, blanks: bool = True) -> None:
        self.conn, self.store = conn, store
        self.registry, self.events = Registry(conn), EventStream(conn)
        self.blanks = Blanks(store.root, enabled=blanks)
        """The file of zeros each version's weights are written over (`backend.blank_adapter_file`)."""

    # publishing ---------------------------------------------------------------
    def publish(self, job: NamedJob, manifest: Manifest, adapter: StagedAdapter, *,
                train_s: float, stepped_at: float, stage_ms: float) -> TrainResult:
        """Write the staged adapter into a new version, rename it into place, announce it, fsync it;
        then start the blank the next version is written over (blanks.py).

        The announcement's stages: `stage` (the adapter into host memory, `stage_ms`; `copy` is its
        device copy), `prepare` (the rest between the optimizer step and the first byte written:
        the step's statistics, the manifest, clearing stale staging directories), `write` (its
        parts inside: `hash`, `weights`, `config`, StagedAdapter.write_ms), `rename`.
        """
        removed = self.store.remove_stale_staging(job.run)
        if removed:
            log.info("store.staging.cleaned run=%s removed=%d", job.run, removed)
        before_ms = (time.time() - stepped_at) * 1000
        t0 = time.perf_counter()
        with self.store.staging(job.run, manifest.version) as staged:
            failpoints.hit("staging_created")
            blank = self.blanks.take()
            try:
                checksums = adapter.write(staged / ADAPTER_DIR, blank=blank)
            finally:
                if blank is not None:
                    self.blanks.give_back(blank)  # nothing left to close once the write took it
            failpoints.hit("weights_written")
            t1 = time.perf_counter()
            weights_size = (staged / ADAPTER_DIR / ADAPTER_WEIGHTS).stat().st_size  # the next blank's
            manifest = self.store.publish(staged, manifest, checksums=checksums, durable=False)
        failpoints.hit("after_rename")
        published_at = time.time()
        t2 = time.perf_counter()
        stages = {"stage": stage_ms, "copy": adapter.copy_ms, "prepare": max(0.0, before_ms - stage_ms),
                  "write": (t1 - t0) * 1000, **adapter.write_ms, "rename": (t2 - t1) * 1000}
        self.announce(manifest, published_at=published_at, stepped_at=stepped_at, stages_ms=stages)
        failpoints.hit("after_announce")
        t3 = time.perf_counter()
        self.store.sync(job.run, manifest.version)
        failpoints.hit("after_sync")
        over = " (over a blank)" if blank is not None and blank.used else ""
        log.info("publish run=%s version=%d bytes=%d copy_ms=%.1f write_ms=%.1f%s rename_ms=%.1f announce_ms=%.1f "
                 "fsync_ms=%.1f (after the announcement)", job.run, manifest.version, adapter.nbytes,
                 adapter.copy_ms, stages["write"], over, stages["rename"], (t3 - t2) * 1000,
                 (time.perf_counter() - t3) * 1000)
        self.blanks.prepare(weights_size)
        return result_of(manifest, reused=False, train_s=train_s, published_at=published_at)

    def announce(self, manifest: Manifest, *, published_at: float, stepped_at: float | None = None,
                 stages_ms: dict[str, float] | None = None) -> None:
        """Register the version and append `adapter_ready`.

        `stepped_at` (the last optimizer step, done on the device), `published_at` (the
        version renamed into place) and `stages_ms` (the publish's stages: device -> host
        copy, write with checksums, rename) let anyone reading the stream time each stage of
        the sync path.
        """
        self.registry.register_version(manifest)
        failpoints.hit("after_register")
        self._append_ready(manifest, published_at=published_at, stepped_at=stepped_at, stages_ms=stages_ms)

    def _append_ready(self, manifest: Manifest, *, published_at: float, stepped_at: float | None = None,
                      stages_ms: dict[str, float] | None = None) -> None:
        adapter = self.store.adapter_dir(manifest.run, manifest.version)
        data: dict[str, JsonValue] = {
            "path": str(adapter.relative_to(self.store.root)),
            "step": manifest.step, "parent": manifest.parent, "metrics": dict(manifest.metrics),
            "published_at": published_at, "stepped_at": stepped_at,
        }
        if stages_ms:
            data["stages_ms"] = {k: round(v, 3) for k, v in stages_ms.items()}
        self.events.append(Event(
            kind=EventKind.ADAPTER_READY, run=manifest.run, version=manifest.version, job_id=manifest.job_id,
            data=data,
        ))

    # finding what a job already did ---------------------------------------------
    def reused(self, job: NamedJob) -> TrainResult | None:
        """The version this job already published, announced (again, if a crash cut that off)."""
        version = self.registry.version_of_job(job.run, job.job_id)
        manifest = self.registry.manifest(job.run, version) if version is not None else None
        if version is not None and manifest is None:
            raise JobRejected(
                f"job_id {job.job_id!r} published {job.run} v{version}, which the retention policy "
                "(retention.keep_versions) has removed since; the job is not trained again", field="job_id")
        if manifest is None:
            return None
        if manifest.job_digest is not None and manifest.job_digest != job_digest(job):
            if isinstance(job, TrainJob):
                raise JobRejected(
                    f"job_id {job.job_id!r} already trained {job.run} v{manifest.version} on other groups; a retry "
                    "must send the same groups, and a new step needs a new job_id (leave job_id out for one)",
                    field="job_id",
                )
            raise JobRejected(
                f"job_id {job.job_id!r} already published {job.run} v{manifest.version} from another payload; a "
                "retry must send the same payload, and a new call needs a new job_id", field="job_id")
        if not self.announced(manifest):
            log.warning("announce.resumed run=%s version=%d job_id=%s: registered but never announced",
                        manifest.run, manifest.version, manifest.job_id)
            self._append_ready(manifest, published_at=manifest.created_at)
        self._sync(manifest)  # its first run may have died before the fsync
        return result_of(manifest, reused=True)

    def _sync(self, manifest: Manifest) -> None:
        try:
            self.store.sync(manifest.run, manifest.version)
        except FileNotFoundError:
            log.warning("sync.skipped run=%s version=%d: its directory is gone from the store",
                        manifest.run, manifest.version)

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

    def adopt_orphans(self, job: NamedJob) -> TrainResult | None:
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
            self._sync(manifest)
            log.info("orphan.adopted run=%s version=%d job_id=%s", job.run, version, manifest.job_id)
        return self.reused(job)

    def _move_aside(self, run: str, version: int) -> None:
        vdir = self.store.version_dir(run, version)
        try:
            vdir.rename(vdir.with_name(f".tmp-rejected-{vdir.name}-{uuid.uuid4().hex[:8]}"))
        except OSError as exc:
            raise CheckpointError(f"{run} v{version} failed verification and cannot be moved aside "
                                  f"({exc}); remove {vdir} by hand") from exc
