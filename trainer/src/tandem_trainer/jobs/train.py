"""The `train` kind: one GRPO step from trajectory groups (tandem's client, `Run.train`).

The job is the unit of idempotency. A job that already published (the registry maps its id
to a version) returns that version again, and a version that reached the store but not the
registry is adopted (publisher.py); only otherwise does it train, under the run's lock, from
the run's newest intact version (versions.py). Its input is checked before any work
(train_checks.py). The step itself runs on the device (step.py), on every rank of a
data-parallel group, which rank 0 sends the step's order first; the adapter it leaves is
staged in host memory and published as the run's next version.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from pydantic import BaseModel, JsonValue

from tandem.adapters import Manifest
from tandem.jobs import TrainJob, TrainResult, groups_digest, parse_job
from tandem.runs import RunSpec
from tandem_trainer.backends.base import ModelInfo
from tandem_trainer.grpo import group_advantages, reward_stats, rollout_stats
from tandem_trainer.jobs.base import Attempt, JobKind
from tandem_trainer.jobs.context import JobContext
from tandem_trainer.jobs.train_checks import check_origins, check_rewards, check_tokens, check_versions
from tandem_trainer.jobs.versions import Trained, publish, resume_point
from tandem_trainer.microbatch import Sample
from tandem_trainer.stage_clock import StageClock
from tandem_trainer.step import StepOrder, train_step

log = logging.getLogger(__name__)


class TrainKind(JobKind[TrainJob, TrainResult]):
    """A `tandem.jobs.TrainJob`: train one GRPO step (or find what the job already published)."""

    name = "train"

    def parse(self, payload: BaseModel | JsonValue) -> TrainJob:
        return payload if isinstance(payload, TrainJob) else parse_job(payload)

    def run(self, ctx: JobContext, job: TrainJob, attempt: Attempt) -> TrainResult:
        result = ctx.publisher.reused(job)
        if result is not None:
            return result
        spec = ctx.run_spec(job.run)
        check_origins(job, ctx.registry)
        info = ctx.backend.model_info(spec.base_model)
        check_tokens(job, info)
        check_rewards(job, spec)
        with ctx.locked(job.run, job.timeout_s):
            result = ctx.publisher.adopt_orphans(job)
            if result is not None:
                return result
            latest = ctx.registry.latest_version(job.run)
            attempt.version = latest + 1
            parent = resume_point(ctx, job.run, latest)
            check_versions(job, spec, latest, parent, ctx.registry)
            digest = groups_digest(job)  # before the step: not between it and the files
            with ctx.device() as gpu_wait_s:
                trained = _train(ctx, job, spec, info, latest, parent, digest, gpu_wait_s)
            # in shared mode the GPU is back with inference while the files are written
            return publish(ctx, job, spec, trained)

    def log_end(self, result: TrainResult, attempt: Attempt) -> None:
        log.info(
            "train.end run=%s job_id=%s version=%d parent=%d reused=%s duration_s=%.3f loss=%.5f "
            "reward_mean=%.4f",
            result.run, result.job_id, result.version, result.parent, result.reused,
            time.perf_counter() - attempt.started, result.metrics.get("loss", 0.0),
            result.metrics.get("reward_mean", 0.0),
        )


def _train(ctx: JobContext, job: TrainJob, spec: RunSpec, info: ModelInfo, latest: int, parent: int, digest: str,
           gpu_wait_s: float | None) -> Trained:
    """One step from `parent` (the run's newest intact version), staged in host memory as version
    `latest + 1`: everything of the job that needs the device. `digest` is the job's
    `groups_digest`, for the manifest.

    `gpu_wait_s` (shared mode: how long the job waited for the GPU) goes into the version's
    metrics with the rest, so `adapter_ready` carries it too: a client that takes its result
    from the event, before rq has the job's, sees the same metrics.
    """
    started = time.perf_counter()
    samples: list[Sample] = []
    rewards: list[float] = []
    flat_groups = 0
    for group in job.groups:
        adv = group_advantages(torch.tensor(group.rewards, dtype=torch.float64),
                               normalize_std=spec.loss.normalize_std)
        flat_groups += int(not adv.any())
        rewards += group.rewards
        samples += [
            Sample(t.prompt_ids, t.completion_ids, t.rollout_logprobs, t.mask, float(a), t.temperature)
            for t, a in zip(group.trajectories, adv, strict=True)
        ]
    order = StepOrder(
        spec=spec, parent=parent, samples=samples, pad_id=info.pad_id, entropy=ctx.entropy,
        version_dir=str(ctx.store.version_dir(job.run, parent)) if parent else None,
        budget=ctx.settings.backend.micro_batch_tokens,
    )
    clock = StageClock(ctx.backend.synchronize if ctx.settings.backend.step_breakdown else None)
    if ctx.group is not None:
        with clock.stage("order"):
            ctx.group.send("step", order=order.model_dump(mode="json"))
    step = train_step(ctx.backend, order, ctx.group, clock)
    train_s = time.perf_counter() - started
    stepped_at = time.time()
    staging = time.perf_counter()
    with clock.stage("stage_adapter"):
        adapter = ctx.backend.stage_adapter()
    stage_ms = (time.perf_counter() - staging) * 1000
    metrics = {
        **step.stats.metrics(), **reward_stats(rewards), **rollout_stats(job.groups, latest),
        "grad_norm": step.grad_norm,
        "tokens": float(step.tokens), "sequences": float(len(samples)),
        "sequence_tokens": float(sum(s.length for s in samples)),
        "groups": float(len(job.groups)), "zero_advantage_groups": float(flat_groups),
        "microbatches": float(step.microbatches), "epochs": float(spec.loss.epochs), "train_s": train_s,
        "activate_s": step.activate_s,
        "ranks": float(ctx.group.world if ctx.group is not None else 1),
    }
    if gpu_wait_s is not None:
        metrics["gpu_wait_s"] = gpu_wait_s
    metrics.update(clock.metrics())
    unwritable = sorted(k for k, v in metrics.items() if not math.isfinite(v))
    if unwritable:  # JSON has no inf or NaN: the manifest would not read back
        log.warning("train.metrics run=%s job_id=%s not finite, left out of the manifest: %s",
                    job.run, job.job_id, {k: metrics.pop(k) for k in unwritable})
    manifest = Manifest(
        run=job.run, version=latest + 1, parent=parent, step=job.step, job_id=job.job_id,
        job_digest=digest, base_model=spec.base_model, lora_rank=spec.lora.r, metrics=metrics,
    )
    return Trained(manifest, adapter, train_s=train_s, stepped_at=stepped_at, stage_ms=stage_ms)

