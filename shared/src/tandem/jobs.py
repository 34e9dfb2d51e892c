"""Train jobs and their results, and how they travel on the rq queue.

Jobs are serialized as JSON (rq's JSONSerializer), validated with pydantic on both ends,
carry an explicit timeout, and are idempotent by `job_id`: a retried job finds the version
it already published instead of publishing a second one. A job trains one run on that run's
own rollouts (`check_origins`), and none of a deleted run of the same name
(`check_incarnation`), checked by the client before it enqueues and by the trainer before it
trains.

Redis is a code-execution boundary: rq imports and calls whatever function and callbacks a
job hash names. The train queue therefore carries `GuardedJob`, an rq job class that
resolves no name but the trainer's job functions (`JOB_FUNCS`: `TRAIN_FUNC`, and the functions of
Tinker's training calls, `tandem.tinker_jobs`) and refuses everything else before anything runs.
"""

from __future__ import annotations

import hashlib
import reprlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from rq import Retry
from rq.exceptions import DeserializationError
from rq.job import UNEVALUATED, Job, JobStatus
from rq.serializers import JSONSerializer
from rq.types import FailureCallbackType, SuccessCallbackType
from rq.utils import import_attribute

from tandem import keys
from tandem.connection import translated
from tandem.errors import JobRefused, ValidationFailed, invalid
from tandem.fair_queue import FairQueue, job_meta
from tandem.runs import check_run_name, parse_adapter_name
from tandem.trajectories import TrajectoryGroup

#: Dotted path of the function the trainer worker runs for each job.
TRAIN_FUNC = "tandem_trainer.worker.run_train_job"

#: The job functions of Tinker's training calls (`tandem.tinker_jobs`, which names them too).
FORWARD_BACKWARD_FUNC = "tandem_trainer.worker.run_forward_backward_job"
OPTIM_STEP_FUNC = "tandem_trainer.worker.run_optim_step_job"
LOAD_STATE_FUNC = "tandem_trainer.worker.run_load_state_job"

#: Every function the trainer worker runs, each with one argument (the payload): the queue's guard
#: allows these and nothing else.
JOB_FUNCS = (TRAIN_FUNC, FORWARD_BACKWARD_FUNC, OPTIM_STEP_FUNC, LOAD_STATE_FUNC)

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


def check_origins(job: TrainJob) -> None:
    """Every trajectory was sampled by the job's run (any version), by the base model asked for by its
    own name, or by what it does not say (`origin` None: built by hand, or by an older client);
    else ValidationFailed naming the first trajectory another run sampled, and both runs.

    Version numbers alone cannot tell: version 2 of another run passes every staleness check of
    this one, and its importance ratio would correct against a policy this run never had.
    """
    for g, group in enumerate(job.groups):
        for t, traj in enumerate(group.trajectories):
            origin = traj.origin
            if origin is None or origin.run is None or origin.run == job.run:
                continue
            field = f"groups.{g}.trajectories.{t}.origin.run"
            raise ValidationFailed(
                f"{field}: group {g} sample {t} was sampled from {origin.describe(traj.version)}; this job "
                f"trains run {job.run!r}: train each run on its own rollouts (sampled with model {job.run!r})",
                field=field,
            )


def check_incarnation(job: TrainJob, floor: Callable[[str, int], int]) -> None:
    """No trajectory sampled by a deleted run of the same name; else ValidationFailed naming it.

    A run deleted and created again starts over at version 0, so its version 2 and the deleted
    run's version 2 share a run name and a number but are other policies. Their adapters' engine
    names tell them apart: `floor(run, version)` (`Registry.load_attempt_floor`) is the first load
    attempt of the run registered now, and a sample whose `origin.adapter` is an earlier attempt
    (`<run>-v2` where this run's v2 serves as `<run>-v2-a1`) was sampled by the deleted run.
    """
    floors: dict[int, int] = {}
    for g, group in enumerate(job.groups):
        for t, traj in enumerate(group.trajectories):
            adapter = traj.origin.adapter if traj.origin is not None else None
            named = parse_adapter_name(adapter) if adapter else None
            if named is None or named[0] != job.run:
                continue
            _, version, attempt = named
            if version not in floors:
                floors[version] = floor(job.run, version)
            if attempt < floors[version]:
                field = f"groups.{g}.trajectories.{t}.origin.adapter"
                raise ValidationFailed(
                    f"{field}: group {g} sample {t} was sampled by adapter {adapter!r}: version {version} of a "
                    f"deleted run that was also named {job.run!r}, another policy than this run's v{version}; "
                    f"train run {job.run!r} on rollouts sampled since it was created",
                    field=field,
                )


def groups_digest(job: TrainJob) -> str:
    """A digest of what the job trains on (its groups): a job id used again with other groups is
    another step under an old name, not a retry."""
    return hashlib.sha256(job.model_dump_json(include={"groups"}).encode()).hexdigest()


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


def parse_job(payload: Any) -> TrainJob:
    """Validate a job payload; raise ValidationFailed naming the bad field."""
    try:
        return TrainJob.model_validate(payload)
    except ValidationError as exc:
        raise invalid("invalid train job", exc) from exc


class GuardedJob(Job):
    """An rq job that can run only one of `JOB_FUNCS`, called with one argument (the payload).

    A job that names another function, an instance method, a success/failure/stopped
    callback, a webhook or a repeat, or whose hash rq cannot read (garbage in any field, data
    that is not JSON), is refused: `func` raises JobRefused before anything is imported or
    called. Callbacks are never resolved and webhooks never sent, whatever the hash says, so
    neither rq's worker nor its registry cleanup can be steered into running foreign code.
    """

    unreadable: str | None = None
    """Why rq could not read the job's hash, when it could not."""
    failure_reported: bool = False
    """Set by the job function once it has appended the failure's `train_failed` itself."""

    def restore(self, raw_data: Any) -> None:
        try:
            super().restore(raw_data)
            self._check_fields()
        except Exception as exc:  # noqa: BLE001 - a hostile hash must fail the job, not the worker
            self.unreadable = f"rq cannot read the job's hash ({type(exc).__name__}: {exc})"
            if self._data is UNEVALUATED:
                self.data = b""
            self.origin = self.origin or keys.TRAIN_QUEUE
            self._status = JobStatus.QUEUED
            self.retries_left, self.retry_intervals, self.repeats_left, self.repeat_intervals = None, None, None, None
            self._dependency_ids, self.meta, self._unreadable_meta = [], {}, None

    def _check_fields(self) -> None:
        """Check the fields rq restores without checking their shape, before rq relies on them."""
        for name, value in (("retry_intervals", self.retry_intervals), ("repeat_intervals", self.repeat_intervals)):
            if value is not None and not (
                isinstance(value, list) and value and all(type(i) is int and i >= 0 for i in value)
            ):
                raise ValueError(f"{name} is {value!r}, not a list of seconds")
        if not isinstance(self._dependency_ids, list) or not all(isinstance(d, str) for d in self._dependency_ids):
            raise ValueError(f"dependency_ids is {self._dependency_ids!r}, not a list of job ids")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta is {self.meta!r}, not a mapping")
        self.to_dict()  # what rq writes back when the job ends must serialize

    def refusal(self) -> str | None:
        """Why this job may not run, or None for a job of the trainer's (`JOB_FUNCS`)."""
        how = (f"the trainer runs only {', '.join(JOB_FUNCS)} (payload); enqueue train jobs with "
               "tandem.jobs.enqueue, Tinker's with tandem.tinker_jobs.enqueue")
        if self.unreadable is not None:
            return f"{self.unreadable}; {how}"
        try:
            func, instance, args, kwargs = self.func_name, self.instance, self.args, self.kwargs
        except DeserializationError as exc:
            return f"the job's data is not rq JSON ({exc.__cause__}); {how}"
        if func not in JOB_FUNCS or instance is not None:
            return f"function {func!r} is not allowed: {how}"
        callbacks = {"on_success": self._success_callback_name, "on_failure": self._failure_callback_name,
                     "on_stopped": self._stopped_callback_name}
        named = [f"{kind}={name!r}" for kind, name in callbacks.items() if name]
        if named:
            return f"callbacks are not allowed ({', '.join(named)}): {how}, with no callbacks"
        if self.webhooks:
            return f"webhooks are not allowed ({', '.join(w.url for w in self.webhooks)}): {how}, with no webhooks"
        if self.repeats_left:
            return f"repeats are not allowed ({self.repeats_left} asked): {how}, once"
        if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
            return (f"{func} takes one argument, the payload, with positional arguments as a list and "
                    f"keywords as a mapping; got {type(args).__name__} {reprlib.repr(args)} and "
                    f"{type(kwargs).__name__} {reprlib.repr(kwargs)}: {how}")
        if not (len(args) == 1 and not kwargs) and not (not args and list(kwargs) == ["payload"]):
            return f"{func} takes one argument, the payload; got {len(args)} positional and keywords {sorted(kwargs)}"
        return None

    def payload(self) -> Any:
        """The job's payload as far as it can be read (None when it cannot)."""
        try:
            args, kwargs = self.args, self.kwargs
        except DeserializationError:
            return None
        if isinstance(args, list | tuple) and args:
            return args[0]
        return kwargs.get("payload") if isinstance(kwargs, dict) else None

    def named_run(self) -> str:
        """The run the payload names when it names a valid one, else ''."""
        payload = self.payload()
        run = payload.get("run") if isinstance(payload, dict) else None
        try:
            return check_run_name(run) if isinstance(run, str) else ""
        except ValueError:
            return ""

    @property
    def func(self) -> Any:
        problem = self.refusal()
        if problem is not None:
            raise JobRefused(problem)
        return import_attribute(next(f for f in JOB_FUNCS if f == self.func_name))  # refusal() found it there

    @property
    def success_callback(self) -> SuccessCallbackType | None:
        return None

    @property
    def failure_callback(self) -> FailureCallbackType | None:
        return None

    @property
    def stopped_callback(self) -> Any:
        return None

    def send_webhooks(self, status: Any, *, exc_string: str | None = None) -> None:
        """Never: a webhook would make the trainer send requests wherever the hash says."""


#: The field of a job's rq hash that says who decided its fate first: the worker that starts it
#: (`STARTED`) or the client that gave up on it while it waited (`CANCELLED`). Set once (HSETNX), so
#: a job taken off the queue by a worker just as its client cancels it either runs or does not,
#: and the client says which.
CLAIM_FIELD = "tandem_claim"
STARTED, CANCELLED = "started", "cancelled"


def claim(conn: redis.Redis, job_key: str, fate: str) -> str:
    """Claim the job whose rq hash is `job_key` for `fate` (`STARTED` or `CANCELLED`) unless it was
    claimed already; returns its fate, the one given or the earlier claim's."""
    with translated(conn, f"claim job {job_key} ({fate})"):
        if conn.hsetnx(job_key, CLAIM_FIELD, fate):
            return fate
        earlier = conn.hget(job_key, CLAIM_FIELD)
    return earlier.decode() if isinstance(earlier, bytes) else str(earlier)


def train_queue(conn: redis.Redis) -> FairQueue:
    """The train queue: `GuardedJob`s, taken in fair turns across runs (tandem.fair_queue)."""
    return FairQueue(keys.TRAIN_QUEUE, connection=conn, serializer=JSONSerializer, job_class=GuardedJob)


def job_tokens(job: TrainJob) -> int:
    """The tokens a train job trains on: its cost in the queue's fair turns."""
    return sum(len(t.prompt_ids) + len(t.completion_ids) for g in job.groups for t in g.trajectories)


def enqueue(conn: redis.Redis, job: TrainJob) -> str:
    """Put a validated job on the train queue; returns its id."""
    return put(conn, TRAIN_FUNC, job.model_dump(mode="json"), job_id=job.job_id, run=job.run,
               timeout_s=job.timeout_s, tokens=job_tokens(job), description=f"train {job.run} step {job.step}")


def put(conn: redis.Redis, func: str, payload: dict[str, Any], *, job_id: str, run: str, timeout_s: int,
        tokens: int, description: str) -> str:
    """Put a validated payload for the job function `func` on the train queue, with its turn's meta
    (run, tokens); its result or failure is kept a week. Returns the job id."""
    with translated(conn, f"enqueue {description} (job {job_id})"):
        train_queue(conn).enqueue(
            func,
            payload,
            job_id=job_id,
            job_timeout=timeout_s,
            result_ttl=7 * 24 * 3600,
            failure_ttl=7 * 24 * 3600,
            # a retried job goes back to the head of the queue: behind the steps pipelined after it,
            # it would publish after them and its rollouts could be refused as stale
            retry=Retry(max=JOB_RETRIES, enqueue_at_front=True),
            description=description,
            meta=job_meta(run, tokens),
        )
    return job_id
