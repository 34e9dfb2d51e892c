"""Train jobs and their results, and how they travel on the rq queue.

Jobs are serialized as JSON (rq's JSONSerializer), validated with pydantic on both ends,
carry an explicit timeout, and are idempotent by `job_id`: a retried job finds the version
it already published instead of publishing a second one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from rq import Queue, Retry
from rq.serializers import JSONSerializer

from tandem import keys
from tandem.errors import BackendUnavailable, ValidationFailed
from tandem.runs import check_run_name
from tandem.trajectories import TrajectoryGroup

#: Dotted path of the function the trainer worker runs for each job.
TRAIN_FUNC = "tandem_trainer.worker.run_train_job"

#: How often rq retries a job whose worker died (the retry is idempotent).
JOB_RETRIES = 3


class TrainJob(BaseModel):
    """One GRPO step's worth of trajectory groups for one run."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex, pattern=r"^[A-Za-z0-9_-]{1,128}$")
    run: str
    step: int = Field(0, ge=0)
    """Client-side step number, for history and plots."""
    groups: list[TrajectoryGroup]
    timeout_s: int = Field(1800, ge=1, le=86400)
    """Longest the job may run before the worker stops it, in seconds."""
    submitted_at: float = Field(default_factory=time.time)

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        return check_run_name(v)

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        if not v:
            raise ValueError("the job has no groups; give at least one trajectory group")
        return v


class TrainResult(BaseModel):
    """What a train job produced."""

    job_id: str
    run: str
    step: int
    version: int
    parent: int
    metrics: dict[str, float] = Field(default_factory=dict)
    train_s: float = 0.0
    """Seconds spent training (load, forward, backward, step)."""
    published_at: float = 0.0
    """Wall-clock time the version was registered."""
    reused: bool = False
    """True when a retry found the version its first attempt published."""


def describe(exc: ValidationError) -> str:
    """One line per problem, each naming the field path, for job failure messages."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<job>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def parse_job(payload: Any) -> TrainJob:
    """Validate a job payload; raise ValidationFailed naming the bad field."""
    try:
        return TrainJob.model_validate(payload)
    except ValidationError as exc:
        first = ".".join(str(x) for x in exc.errors()[0]["loc"]) if exc.errors() else None
        raise ValidationFailed(f"invalid train job: {describe(exc)}", field=first) from exc


def train_queue(conn: redis.Redis) -> Queue:
    return Queue(keys.TRAIN_QUEUE, connection=conn, serializer=JSONSerializer)


def enqueue(conn: redis.Redis, job: TrainJob) -> str:
    """Put a validated job on the train queue; returns its id."""
    try:
        train_queue(conn).enqueue(
            TRAIN_FUNC,
            job.model_dump(mode="json"),
            job_id=job.job_id,
            job_timeout=job.timeout_s,
            result_ttl=7 * 24 * 3600,
            failure_ttl=7 * 24 * 3600,
            retry=Retry(max=JOB_RETRIES),
            description=f"train {job.run} step {job.step}",
        )
    except redis.RedisError as exc:
        raise BackendUnavailable(f"cannot enqueue job {job.job_id} for run {job.run!r}: {exc}") from exc
    return job.job_id
