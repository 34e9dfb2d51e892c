"""What a train job is checked for before it trains, each failure a `JobRejected` naming the field.

Everything that would make a job fail the same way every time is checked before any work: the
run that sampled its trajectories against the run it trains (`tandem.jobs.check_origins`, which
the client ran too: any client can enqueue a job, so the trainer's check is the one that holds), its
token ids against the base model (vocabulary, context, the chat template's turn-start token in
trained spans) and its rewards against the run's loss before the run's lock and the GPU are
taken; the versions that sampled its trajectories against the version it trains from once the
lock is held, since only then is that version known.
"""

from __future__ import annotations

import torch

from tandem import jobs
from tandem.errors import TandemError, ValidationFailed
from tandem.jobs import TrainJob
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem_trainer.backends.base import ModelInfo
from tandem_trainer.errors import JobRejected
from tandem_trainer.grpo import group_advantages
from tandem_trainer.turns import check_trained_spans


def check_origins(job: TrainJob, registry: Registry) -> None:
    """No trajectory another run sampled (`tandem.jobs.check_origins`) nor a deleted run of the same
    name (`tandem.jobs.check_incarnation`), as a JobRejected naming it."""
    try:
        jobs.check_origins(job)
        jobs.check_incarnation(job, registry.load_attempt_floor)
    except ValidationFailed as exc:
        raise JobRejected(str(exc), field=exc.field) from exc


def check_tokens(job: TrainJob, info: ModelInfo) -> None:
    """Token ids below the vocabulary, sequences within the context, something left to train on."""
    for g, group in enumerate(job.groups):
        for t, traj in enumerate(group.trajectories):
            path = f"groups.{g}.trajectories.{t}"
            for name, ids in (("prompt_ids", traj.prompt_ids), ("completion_ids", traj.completion_ids)):
                bad = max(ids)
                if bad >= info.vocab_size:
                    raise JobRejected(
                        f"{path}.{name}: token id {bad} is outside the vocabulary of "
                        f"{info.base_model} (vocab_size {info.vocab_size}); ids must be below it",
                        field=f"{path}.{name}",
                    )
            total = len(traj.prompt_ids) + len(traj.completion_ids)
            if total > info.max_positions:
                raise JobRejected(
                    f"{path}: prompt_ids ({len(traj.prompt_ids)}) + completion_ids "
                    f"({len(traj.completion_ids)}) = {total} tokens, longer than the context of "
                    f"{info.base_model} (max_position_embeddings {info.max_positions})",
                    field=f"{path}.completion_ids",
                )
    if info.turn_start_id is not None:
        check_trained_spans(job, info.turn_start_id, info.turn_start)
    if not any(any(traj.mask) for group in job.groups for traj in group.trajectories):
        raise JobRejected("groups: every completion token is masked out; nothing to train on",
                          field="groups")


def check_rewards(job: TrainJob, spec: RunSpec) -> None:
    """Advantages the loss can hold: any finite rewards normalise, but without normalize_std they
    are the rewards' own scale. Checked before the run's lock and the GPU are taken."""
    if spec.loss.normalize_std:
        return
    for g, group in enumerate(job.groups):
        adv = group_advantages(torch.tensor(group.rewards, dtype=torch.float64), normalize_std=False)
        if not bool(torch.isfinite(adv).all()):
            raise JobRejected(
                f"groups.{g}: rewards {group.rewards} give advantages beyond float32 (|a| > 3.4e38) with "
                f"run {spec.name!r}'s loss.normalize_std off; scale the rewards down, or create the run "
                "with normalize_std on", field=f"groups.{g}.trajectories",
            )


def check_versions(job: TrainJob, spec: RunSpec, latest: int, parent: int, registry: Registry) -> None:
    """Each trajectory's version against `parent`, the version this job trains from: the newest
    registered one (`latest`), or an older one when newer ones cannot be trained from (their
    files gone or not verifying). Distance is counted from `parent`, the policy the step updates
    (the importance ratio corrects for the sampling policy either way, within
    max_staleness_steps), so a run whose newest version is broken goes on from the one before."""
    for g, group in enumerate(job.groups):
        for t, traj in enumerate(group.trajectories):
            field = f"groups.{g}.trajectories.{t}.version"
            if traj.version > latest:
                raise JobRejected(
                    f"{field}: version {traj.version} is newer than run {spec.name!r}'s latest "
                    f"version {latest}; it cannot have sampled this trajectory", field=field,
                )
            if traj.version - parent > spec.max_staleness_steps:
                raise JobRejected(
                    f"{field}: the trajectory comes from version {traj.version}, but run {spec.name!r} "
                    f"trains from version {parent}: the files of version(s) {parent + 1}-{latest} are "
                    "gone from the store or do not verify (the trainer's log says which), and a step "
                    f"from version {parent} is {traj.version - parent} versions from it, more than "
                    f"max_staleness_steps={spec.max_staleness_steps}; sample again from version {parent} "
                    f"(pin model '{spec.name}@v{parent}')", field=field,
                )
            if parent - traj.version > spec.max_staleness_steps:
                raise JobRejected(
                    f"{field}: the trajectory comes from version {traj.version}, "
                    f"{parent - traj.version} versions older than version {parent} this job trains "
                    f"from; run {spec.name!r} allows max_staleness_steps={spec.max_staleness_steps}: sample "
                    f"again with model {spec.name!r} (its newest version)" + _not_serving(registry, spec.name, parent),
                    field=field,
                )


def _not_serving(registry: Registry, run: str, parent: int) -> str:
    """Why a client may have no newer rollouts: the version the job trains from does not serve."""
    try:
        serving = registry.serving(run)
    except TandemError:
        return ""
    if serving >= parent:
        return ""
    return (f"; inference serves version {serving}, not yet version {parent}: it may still be loading (then "
            f"sample once it serves: train() returns when it does), or an adapter_rejected event of version "
            f"{parent} says why it will not (e.g. the engine's adapter slots are full: fix that and restart the "
            "inference service, which loads the newest version)")
