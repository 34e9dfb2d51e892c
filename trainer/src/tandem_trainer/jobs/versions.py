"""A run's versions as a job meets them: where training resumes, and publishing what it trained.

Whatever trains a version (a kind's step) hands it over as a `Trained`: its manifest and its
adapter staged in host memory. `publish` writes, registers and announces it (publisher.py),
tells every rank which version it now holds, then does what is off the path to serving:
the optimizer state beside the version, the retention policy (store_cleanup.py), the run's
metrics, the experiment tracker. A failure of the state, the retention or the tracker costs only
the state, a removal put off to the next publish, or the curve; never the published version.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pydantic import JsonValue

from tandem.adapters import Manifest
from tandem.errors import AdapterRejected, VersionExists
from tandem.jobs import TrainResult
from tandem.runs import RunSpec
from tandem_trainer import failpoints
from tandem_trainer.adapter_files import StagedAdapter
from tandem_trainer.errors import CheckpointError
from tandem_trainer.jobs.context import JobContext
from tandem_trainer.publisher import NamedJob
from tandem_trainer.store_cleanup import retire_old_versions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trained:
    """A step's outcome before it is published: the version's manifest and its staged adapter."""

    manifest: Manifest
    adapter: StagedAdapter
    train_s: float
    stepped_at: float
    """Wall clock when the optimizer step was done on the device."""
    stage_ms: float
    """How long staging the adapter in host memory took: the device copy (`adapter.copy_ms`) and
    what the backend does before it (finding the adapter's tensors)."""


# where training resumes -------------------------------------------------------
def resume_point(ctx: JobContext, run: str, latest: int) -> int:
    """The version training starts from: the newest registered one, or, when its files are
    gone from the store (a directory deleted by hand), the newest one below it whose files
    are all there (0: a fresh adapter). The new version's manifest names it as parent. A
    version the backend holds in memory (training or resident) is not read to be checked."""
    if latest == 0 or ctx.backend.holds(run, latest, ctx.store.version_dir(run, latest)):
        return latest
    if not ctx.store.run_dir(run).is_dir():
        # not one version deleted by hand: the run's whole directory (or the store) is not there,
        # as when a volume failed to mount; starting over from the base model would throw the
        # run's training away without a word
        raise CheckpointError(
            f"run {run!r} has {latest} registered version(s) but its directory {ctx.store.run_dir(run)} "
            f"is not in the adapter store {ctx.store.root} (a volume not mounted?); mount the store the "
            "run was trained in, or create a new run to start over from the base model")
    for version in range(latest, 0, -1):
        missing = _missing(ctx, run, version)
        if missing is None:
            if version != latest:
                log.warning("train.resumed run=%s from_version=%d newest=%d: the newer versions' files "
                            "are gone from the store or do not verify", run, version, latest)
            return version
        log.warning("train.skip run=%s version=%d: %s", run, version, missing)
    return 0


def _missing(ctx: JobContext, run: str, version: int) -> str | None:
    """Why a version's files cannot be trained from (its manifest or a file it lists is
    missing, or a checksum does not match: a version torn by a power loss before its
    files reached the disk), or None."""
    try:
        ctx.store.verify(run, version)
    except AdapterRejected as exc:
        return str(exc)
    return None


# publishing -------------------------------------------------------------------
def publish(ctx: JobContext, job: NamedJob, spec: RunSpec, trained: Trained) -> TrainResult:
    """Publish the trained version and announce it, then attach its optimizer state, retire old
    versions, and log its step to the metrics and the tracker (off the path to serving: after the
    announcement)."""
    result = _publish(ctx, job, trained)
    _save_state(ctx, job, trained.manifest, result.parent)
    retire_old_versions(ctx.store, ctx.registry, job.run, result.version, ctx.settings.retention, ctx.metrics)
    ctx.metrics.record_step(job.run, result.version, result.metrics)
    if ctx.tracker is not None:
        _track(ctx, job, spec, result, trained.stepped_at)
    return result


def _publish(ctx: JobContext, job: NamedJob, trained: Trained) -> TrainResult:
    t0 = time.perf_counter()
    result = ctx.publisher.publish(job, trained.manifest, trained.adapter, train_s=trained.train_s,
                                   stepped_at=trained.stepped_at, stage_ms=trained.stage_ms)
    ctx.metrics.stage_seconds.labels("publish").observe(time.perf_counter() - t0)
    version_dir = ctx.store.version_dir(job.run, result.version)
    ctx.backend.mark_active(job.run, result.version, version_dir)
    ctx.tell("published", run=job.run, version=result.version, version_dir=str(version_dir))
    return result


def _track(ctx: JobContext, job: NamedJob, spec: RunSpec, result: TrainResult, stepped_at: float) -> None:
    """Hand the step to the experiment tracker's queue, which never waits on the tracker; the
    tracker's thread logs and counts what fails (trackers/outbox.py): it costs only its curve."""
    assert ctx.tracker is not None
    ctx.tracker.log_step(spec, result, stepped_at, ctx.events)


def _save_state(ctx: JobContext, job: NamedJob, manifest: Manifest, parent: int) -> None:
    """Attach the optimizer state to the published version; a failure costs only the state."""
    version = manifest.version
    state: dict[str, JsonValue] = {"run": job.run, "version": version, "parent": parent, "step": manifest.step,
                                   "job_id": job.job_id}
    t0 = time.perf_counter()
    try:
        with ctx.store.trainer_state(job.run, version) as state_dir:
            ctx.backend.save_state(state_dir, trainer_state=state)
            failpoints.hit("state_written")
        log.info("state.saved run=%s version=%d state_ms=%.1f", job.run, version, (time.perf_counter() - t0) * 1000)
        ctx.metrics.stage_seconds.labels("state").observe(time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - the version is already out; only its state is lost
        unexpected = not isinstance(exc, CheckpointError | OSError | VersionExists)
        log.warning("trainer state of %s v%d not saved (%s); resuming from it starts the optimizer fresh",
                    job.run, version, exc, exc_info=unexpected)
        if unexpected:
            ctx.invalidate()  # e.g. a device error: reload from the store next time
