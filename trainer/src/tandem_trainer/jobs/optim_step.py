"""The `optim_step` kind: Tinker's `optim_step`, one Adam step on the held gradients, published.

The job is the unit of idempotency, as a train job is: one that already published (the registry
maps its id to a version) returns that version again, and a version that reached the store but
not the registry is adopted (publisher.py). Otherwise, under the run's lock, the run's newest
version becomes the training adapter with the gradients the run holds (tinker_common.py), and
the step goes ahead when the held gradients are those of `gradients_from`, but for the jobs among
them that failed (refused for their input, or out of retries): those added nothing, and their
callers were told so. Gradients that are missing (the trainer restarted after their
forward_backward jobs finished, or another worker ran them) are computed again from those jobs'
payloads, which rq keeps: no optim_step came between (the Tinker service orders them so), so the
adapter is the version they ran on and the gradients are theirs. Only when that cannot be done
(a job's record expired, one has not finished, gradients held that the step does not name) is
the job rejected, never retried, naming the jobs; the held gradients are dropped, so that the
forward_backward calls sent again start clean.

The step: the call's `AdamParams` set on the run's optimizer (learning rate, betas, eps, decoupled
weight decay: torch's AdamW), the gradient clipped to `grad_clip_norm` when that is above 0,
one optimizer step; the adapter is then published as the run's next version with its optimizer
state (versions.publish: `adapter_ready` is announced). Its manifest's step is its version.
"""

from __future__ import annotations

import logging
import time

from pydantic import BaseModel, JsonValue, ValidationError
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem.adapters import Manifest
from tandem.connection import translated
from tandem.jobs import TrainResult
from tandem.runs import RunSpec
from tandem.tinker_jobs import ForwardBackwardJob, OptimStepJob, OptimStepResult
from tandem_trainer.errors import JobRejected
from tandem_trainer.jobs.base import Attempt, JobKind
from tandem_trainer.jobs.context import JobContext
from tandem_trainer.jobs.forward_backward import accumulate
from tandem_trainer.jobs.tinker_common import activate_newest, parsed, single_process
from tandem_trainer.jobs.versions import Trained, publish
from tandem_trainer.publisher import job_digest

log = logging.getLogger(__name__)


class OptimStepKind(JobKind[OptimStepJob, OptimStepResult]):
    """A `tandem.tinker_jobs.OptimStepJob`: apply the held gradients, publish the next version."""

    name = "optim_step"

    def parse(self, payload: BaseModel | JsonValue) -> OptimStepJob:
        return parsed(OptimStepJob, payload, self.name)

    def run(self, ctx: JobContext, job: OptimStepJob, attempt: Attempt) -> OptimStepResult:
        single_process(ctx, self.name)
        found = ctx.publisher.reused(job)
        if found is not None:
            return _result(found)
        spec = ctx.run_spec(job.run)
        with ctx.locked(job.run, job.timeout_s):
            found = ctx.publisher.adopt_orphans(job)
            if found is not None:
                return _result(found)
            with ctx.device() as gpu_wait_s:
                latest, parent = activate_newest(ctx, spec)
                attempt.version = latest + 1
                applied = _check_held(ctx, job, spec)
                trained = _step(ctx, job, spec, latest, parent, gpu_wait_s, applied=len(applied))
            return _result(publish(ctx, job, spec, trained))

    def log_end(self, result: OptimStepResult, attempt: Attempt) -> None:
        log.info("optim_step.end run=%s job_id=%s version=%d duration_s=%.3f grad_norm=%.5f",
                 result.run, result.job_id, result.version, time.perf_counter() - attempt.started,
                 result.metrics.get("grad_norm", 0.0))


def _check_held(ctx: JobContext, job: OptimStepJob, spec: RunSpec) -> list[str]:
    """The forward_backward jobs whose gradients the step applies: `job.gradients_from` but those
    that failed (refused or out of retries: they added nothing, as their callers were told), held
    now (missing ones that finished computed again); else the job is rejected (and the held
    gradients dropped)."""
    held = ctx.backend.gradient_jobs()
    if held == job.gradients_from:
        return held
    status = {j: _status(ctx, j) for j in job.gradients_from if j not in held}
    failed = [j for j, s in status.items() if s in ADDED_NOTHING]
    wanted = [j for j in job.gradients_from if j not in failed]
    if failed:
        log.info("optim_step.without run=%s job_id=%s failed=%s: forward_backward jobs that failed add nothing",
                 job.run, job.job_id, failed)
    missing = [j for j in wanted if j not in held]
    extra = [j for j in held if j not in wanted]
    unfinished = [j for j in missing if status[j] not in (JobStatus.FINISHED, None)]  # None: expired, lost
    if held == wanted or (missing and not extra and not unfinished and _recompute(ctx, job, spec, missing)):
        return wanted
    why = []
    states = {j: s.value for j, s in status.items() if s is not None}
    if unfinished:
        why.append(f"forward_backward job(s) {unfinished} have not finished "
                   f"({', '.join(states[j] for j in unfinished)})")
    if missing and not unfinished:
        why.append(f"the gradients of forward_backward job(s) {missing} were lost (the trainer restarted, a failed "
                   "job dropped them, or another trainer worker ran them)")
    if extra:
        why.append(f"the trainer held gradients of job(s) {extra} that the step does not name")
    if not why:
        why.append(f"the trainer accumulated them in another order: {held}")
    ctx.backend.drop_gradients(f"optim_step {job.job_id} named other gradients")
    raise JobRejected(
        f"gradients_from: optim_step {job.job_id} of run {job.run!r} applies the gradients of {wanted}, "
        f"but {'; and '.join(why)}. Nothing was applied and the held gradients were dropped: send the "
        "forward_backward calls again, then optim_step", field="gradients_from")


#: A forward_backward job in one of these states added no gradient: refused (bad input) or out of
#: retries, its caller told so; cancelled or stopped before it ran.
ADDED_NOTHING = frozenset({JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED})


def _status(ctx: JobContext, job_id: str) -> JobStatus | None:
    """The queue's state of a job (None: its record expired or never was)."""
    with translated(ctx.conn, f"read the state of forward_backward job {job_id}"):
        try:
            return Job.fetch(job_id, connection=ctx.conn, serializer=JSONSerializer).get_status()
        except NoSuchJobError:
            return None


def _recompute(ctx: JobContext, job: OptimStepJob, spec: RunSpec, missing: list[str]) -> bool:
    """The gradients of the finished forward_backward jobs `missing`, computed again from their
    payloads on the active adapter and held; False (nothing added) when a payload cannot be read
    or is not a forward_backward of this run that trains."""
    payloads = []
    for job_id in missing:
        try:
            with translated(ctx.conn, f"read forward_backward job {job_id}"):
                fb = ForwardBackwardJob.model_validate(Job.fetch(job_id, connection=ctx.conn,
                                                                 serializer=JSONSerializer).args[0])
        except (NoSuchJobError, ValidationError, IndexError, TypeError) as exc:
            log.warning("optim_step.recompute_impossible run=%s job_id=%s: %s", job.run, job_id, exc)
            return False
        if fb.run != job.run or fb.forward_only:
            return False
        payloads.append(fb)
    started = time.perf_counter()
    for fb in payloads:
        accumulate(ctx, fb, spec)
    log.warning("optim_step.recomputed run=%s job_id=%s gradients_of=%s duration_s=%.3f: the trainer no longer "
                "held them (it restarted, or another worker ran them)", job.run, job.job_id, missing,
                time.perf_counter() - started)
    return True


def _step(ctx: JobContext, job: OptimStepJob, spec: RunSpec, latest: int, parent: int,
          gpu_wait_s: float | None, *, applied: int) -> Trained:
    """One AdamW step with the call's parameters, staged in host memory as version `latest + 1`."""
    started = time.perf_counter()
    adam = job.adam
    ctx.backend.set_adam(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
    grad_norm = ctx.backend.step(adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf"))
    ctx.backend.synchronize()
    stepped_at = time.time()
    train_s = time.perf_counter() - started
    staging = time.perf_counter()
    adapter = ctx.backend.stage_adapter()
    stage_ms = (time.perf_counter() - staging) * 1000
    metrics = {"grad_norm": grad_norm, "learning_rate": adam.learning_rate, "gradient_jobs": float(applied),
               "train_s": train_s}
    if gpu_wait_s is not None:
        metrics["gpu_wait_s"] = gpu_wait_s
    manifest = Manifest(
        run=job.run, version=latest + 1, parent=parent, step=latest + 1, job_id=job.job_id,
        job_digest=job_digest(job), base_model=spec.base_model, lora_rank=spec.lora.r, metrics=metrics,
    )
    return Trained(manifest, adapter, train_s=train_s, stepped_at=stepped_at, stage_ms=stage_ms)


def _result(published: TrainResult) -> OptimStepResult:
    return OptimStepResult(job_id=published.job_id, run=published.run, version=published.version,
                           metrics=published.metrics, published_at=published.published_at)
