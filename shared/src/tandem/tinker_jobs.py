"""The trainer jobs behind Tinker's training calls, as the Tinker service sends them.

A Tinker model is a tandem run. Its training calls travel on the train queue like a GRPO step,
as jobs of their own kinds, in the order the service enqueues them (one model's requests in
its `seq_id` order):

- `forward_backward` (`ForwardBackwardJob`): a forward pass over the datums with the named loss,
  and, unless `forward_only`, its backward pass. The gradients stay in the trainer's memory with
  the run (resident-run state) and accumulate until an `optim_step` applies them. The result
  carries each datum's per-token outputs (`loss_fn_outputs`, e.g. the new policy's `logprobs`)
  and the loss's metrics. It publishes nothing.
- `optim_step` (`OptimStepJob`): one Adam step on the gradients accumulated since the last step,
  with the call's Adam parameters; it publishes the result as the run's next immutable version
  (weights and optimizer state in the store, `adapter_ready` announced), so every step is a
  version that the engines can load and `save_weights` / `save_weights_for_sampler` only name
  an existing version. `gradients_from` lists the `forward_backward` jobs whose gradients the
  step applies: the trainer refuses the step when it does not hold exactly those (a trainer that
  restarted between them lost its gradients; the client sends the forward_backward again).
- `load_state` (`LoadStateJob`): make a version of a run (this one or another on the same base
  model) the run's next version, with or without its optimizer state; pending gradients are
  dropped.

`enqueue` puts any of them on the train queue, with the train job's retry policy: a job whose
worker died is retried, at the head of the queue. A retried `optim_step` or `load_state` finds the
version its first attempt published (by `job_id`); a retried `forward_backward` runs again, its
gradients held with the run's only if the trainer still holds the earlier ones (else the
`optim_step` is refused, naming the jobs whose gradients were lost). A job rejected for its input
(`train_failed` with `field`, rq's FAILED) is never retried.

Datums are Tinker's, flattened: the model input's tokens, and `inputs` keyed by Tinker's
`loss_fn_inputs` names (`target_tokens`, `weights`, `advantages`, `logprobs`, ...), each a list
as long as `tokens`.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

import redis
from pydantic import BaseModel, ConfigDict, Field, field_validator

# The job functions the trainer worker runs for these kinds (the queue's guard allows them),
# named beside the guard and named here too.
from tandem.jobs import FORWARD_BACKWARD_FUNC as FORWARD_BACKWARD_FUNC
from tandem.jobs import LOAD_STATE_FUNC as LOAD_STATE_FUNC
from tandem.jobs import OPTIM_STEP_FUNC as OPTIM_STEP_FUNC
from tandem.jobs import put
from tandem.runs import check_run_name

#: Losses the trainer computes, by Tinker's names.
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
LossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo"]

_JOB_ID = r"^[A-Za-z0-9_-]{1,128}$"


class _Job(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex, pattern=_JOB_ID)
    run: str
    seq: int = Field(0, ge=0)
    """The Tinker request's `seq_id` within its model (for logs and ordering checks)."""
    timeout_s: int = Field(1800, ge=1, le=86400)
    submitted_at: float = Field(default_factory=time.time)

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        return check_run_name(v)


class Datum(BaseModel):
    """One Tinker datum: its tokens and its loss inputs, each a list as long as `tokens`."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int] = Field(min_length=1)
    inputs: dict[str, list[float]]
    """Tinker's `loss_fn_inputs` by name (`target_tokens` as whole numbers)."""


class ForwardBackwardJob(_Job):
    datums: list[Datum] = Field(min_length=1)
    loss_fn: LossName
    loss_fn_config: dict[str, float] = Field(default_factory=dict)
    """Tinker's `loss_fn_config` (e.g. `clip_low_threshold`, `clip_high_threshold`)."""
    forward_only: bool = False
    """Tinker's `forward`: the outputs and metrics, no gradients."""


class ForwardBackwardResult(BaseModel):
    job_id: str
    run: str
    loss_fn_outputs: list[dict[str, list[float]]]
    """Per datum, by name (`logprobs`: the target tokens' log-probabilities under the weights now)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Tinker's metric names (`loss:sum`, ...)."""


class AdamParams(BaseModel):
    """Tinker's `AdamParams`."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(1e-4, ge=0.0, le=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    grad_clip_norm: float = Field(0.0, ge=0.0)
    """0: no clipping."""


class OptimStepJob(_Job):
    adam: AdamParams = AdamParams()
    gradients_from: list[str] = Field(default_factory=list)
    """The forward_backward job ids whose gradients this step applies, in order."""


class OptimStepResult(BaseModel):
    job_id: str
    run: str
    version: int
    """The version the step published."""
    metrics: dict[str, float] = Field(default_factory=dict)
    published_at: float = 0.0


class LoadStateJob(_Job):
    source_run: str
    source_version: int = Field(ge=1)
    with_optimizer: bool = True

    @field_validator("source_run")
    @classmethod
    def _source_run(cls, v: str) -> str:
        return check_run_name(v)


class LoadStateResult(BaseModel):
    job_id: str
    run: str
    version: int
    """The version of `run` that now holds the loaded state."""


TinkerJob = ForwardBackwardJob | OptimStepJob | LoadStateJob


def job_func(job: TinkerJob) -> str:
    """The trainer's job function for `job`'s kind."""
    if isinstance(job, ForwardBackwardJob):
        return FORWARD_BACKWARD_FUNC
    return OPTIM_STEP_FUNC if isinstance(job, OptimStepJob) else LOAD_STATE_FUNC


def job_tokens(job: TinkerJob) -> int:
    """The tokens a job trains on, its cost in the queue's fair turns (1 for a step or a load)."""
    return sum(len(d.tokens) for d in job.datums) if isinstance(job, ForwardBackwardJob) else 1


def enqueue(conn: redis.Redis, job: TinkerJob) -> str:
    """Put a validated Tinker job on the train queue, after the jobs already there; returns its id
    (rq's job id is the payload's `job_id`). Its result (the kind's `...Result` as JSON) is kept a
    week, as a train job's."""
    func = job_func(job)
    return put(conn, func, job.model_dump(mode="json"), job_id=job.job_id, run=job.run, timeout_s=job.timeout_s,
               tokens=job_tokens(job), description=f"{func.rpartition('.')[2]} {job.run} seq {job.seq}")
