"""The `load_state` kind: Tinker's `load_state`, a published version made the run's next version.

`source_run` at `source_version` (the run itself or another run on the same base model, with the
same LoRA rank and target modules) is read from the store into the run's adapter, with its
optimizer state when `with_optimizer` (else the optimizer starts fresh), and published as the
run's next version, so that the engines can load it and the next `forward_backward` trains from
it. The gradients the run held are dropped first (logged as `gradients.dropped`).

Idempotent by job id as `optim_step` is (publisher.py): a retry returns the version its first
attempt published. A source that does not exist, on another base model or LoRA shape, or a
version that is not there (never published, or removed by the retention policy) rejects the
job naming `source_run` or `source_version`.
"""

from __future__ import annotations

import logging
import time

from pydantic import BaseModel, JsonValue

from tandem.adapters import Manifest
from tandem.errors import AdapterRejected, RunNotFound
from tandem.runs import RunSpec
from tandem.tinker_jobs import LoadStateJob, LoadStateResult
from tandem_trainer.errors import JobRejected
from tandem_trainer.jobs.base import Attempt, JobKind
from tandem_trainer.jobs.context import JobContext
from tandem_trainer.jobs.tinker_common import parsed, single_process
from tandem_trainer.jobs.versions import Trained, publish
from tandem_trainer.publisher import job_digest

log = logging.getLogger(__name__)


class LoadStateKind(JobKind[LoadStateJob, LoadStateResult]):
    """A `tandem.tinker_jobs.LoadStateJob`: a version of a run becomes this run's next version."""

    name = "load_state"

    def parse(self, payload: BaseModel | JsonValue) -> LoadStateJob:
        return parsed(LoadStateJob, payload, self.name)

    def run(self, ctx: JobContext, job: LoadStateJob, attempt: Attempt) -> LoadStateResult:
        single_process(ctx, self.name)
        found = ctx.publisher.reused(job)
        if found is not None:
            return LoadStateResult(job_id=job.job_id, run=job.run, version=found.version)
        spec = ctx.run_spec(job.run)
        _check_source(ctx, job, spec)
        with ctx.locked(job.run, job.timeout_s):
            found = ctx.publisher.adopt_orphans(job)
            if found is not None:
                return LoadStateResult(job_id=job.job_id, run=job.run, version=found.version)
            latest = ctx.registry.latest_version(job.run)
            attempt.version = latest + 1
            with ctx.device():
                trained = _load(ctx, job, spec, latest)
            published = publish(ctx, job, spec, trained)
        return LoadStateResult(job_id=job.job_id, run=job.run, version=published.version)

    def log_end(self, result: LoadStateResult, attempt: Attempt) -> None:
        log.info("load_state.end run=%s job_id=%s version=%d duration_s=%.3f", result.run, result.job_id,
                 result.version, time.perf_counter() - attempt.started)


def _check_source(ctx: JobContext, job: LoadStateJob, spec: RunSpec) -> None:
    """The source run exists, fits the run's model and LoRA, and its version is in the store."""
    try:
        source = ctx.registry.get_run(job.source_run)
    except RunNotFound as exc:
        raise JobRejected(f"source_run: {exc}", field="source_run") from exc
    if source.base_model != spec.base_model:
        raise JobRejected(f"source_run: run {job.source_run!r} is on base model {source.base_model!r}, run {job.run!r} "
                          f"on {spec.base_model!r}; load a state of a run on the same base model", field="source_run")
    shape = (spec.lora.r, sorted(spec.lora.target_modules))
    if (source.lora.r, sorted(source.lora.target_modules)) != shape:
        raise JobRejected(f"source_run: run {job.source_run!r} has LoRA r={source.lora.r} targets="
                          f"{sorted(source.lora.target_modules)}, run {job.run!r} r={shape[0]} targets={shape[1]}; "
                          "load a state of a run with the same LoRA shape", field="source_run")
    if ctx.registry.manifest(job.source_run, job.source_version) is None:
        latest = ctx.registry.latest_version(job.source_run)
        why = "removed by the retention policy" if job.source_version <= latest else f"its newest is v{latest}"
        raise JobRejected(f"source_version: run {job.source_run!r} has no version {job.source_version} ({why})",
                          field="source_version")
    try:
        ctx.store.verify(job.source_run, job.source_version)
    except AdapterRejected as exc:
        raise JobRejected(f"source_version: {job.source_run} v{job.source_version} cannot be loaded: {exc}",
                          field="source_version") from exc


def _load(ctx: JobContext, job: LoadStateJob, spec: RunSpec, latest: int) -> Trained:
    """The source version read into the run's adapter (its optimizer state, or a fresh one), staged
    as version `latest + 1`."""
    started = time.perf_counter()
    source_dir = ctx.store.version_dir(job.source_run, job.source_version)
    active = ctx.backend.active
    if active is not None and active[0] == job.run:  # (held gradients of the run set aside are dropped,
        ctx.backend.drop_gradients(f"load_state {job.job_id} replaces the run's state")  # and said, by activate)
    ctx.backend.activate(spec, job.source_version, source_dir)  # the run's LoRA, the source's tensors
    if not job.with_optimizer:
        ctx.backend.reset_optimizer()
    staging = time.perf_counter()
    adapter = ctx.backend.stage_adapter()
    stage_ms = (time.perf_counter() - staging) * 1000
    log.info("load_state.loaded run=%s version=%d from=%s@%d with_optimizer=%s", job.run, latest + 1,
             job.source_run, job.source_version, job.with_optimizer)
    train_s = time.perf_counter() - started
    manifest = Manifest(
        run=job.run, version=latest + 1, parent=latest, step=latest + 1, job_id=job.job_id,
        job_digest=job_digest(job), base_model=spec.base_model, lora_rank=spec.lora.r,
        metrics={"source_version": float(job.source_version), "with_optimizer": float(job.with_optimizer)},
    )
    return Trained(manifest, adapter, train_s=train_s, stepped_at=time.time(), stage_ms=stage_ms)
