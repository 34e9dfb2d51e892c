"""A job's failure, for any kind: what names it, what it is reported as, whether a retry may help.

A failed job gets one `<kind>.failed` line and one `train_failed` event (runner.py) naming the
run, the job, the field when its input was at fault, the message, and how many retries the
queue has left for it: none when a retry would meet the same failure (`not_retried`).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, JsonValue
from rq.timeouts import JobTimeoutException

from tandem_trainer.errors import JobRejected, TrainStepFailed


def names(payload: BaseModel | JsonValue, queued_as: str | None) -> tuple[str, str | None]:
    """The run and job id a payload names, read before it is validated (for its failure event);
    `queued_as` (the queue's id of the job) when the payload names no job id."""
    fields = payload.model_dump(include={"run", "job_id"}) if isinstance(payload, BaseModel) else payload
    run = fields.get("run") if isinstance(fields, dict) else None
    named = fields.get("job_id") if isinstance(fields, dict) else None
    return (run if isinstance(run, str) else "", named if isinstance(named, str) else queued_as)


def translate(exc: Exception) -> Exception:
    """What a failure is reported as: torch's and rq's errors as the trainer's, saying what to do."""
    if isinstance(exc, torch.OutOfMemoryError):
        return TrainStepFailed(
            f"out of memory while training ({exc}); lower TANDEM_BACKEND__MICRO_BATCH_TOKENS"
        )
    if isinstance(exc, JobTimeoutException):
        return TrainStepFailed(f"{exc}: the job ran out of its time and is not retried; submit it again with "
                               "a larger timeout_s (run.train(..., timeout_s=...) or the client's "
                               "train_timeout_s)")
    return exc


def not_retried(exc: BaseException) -> bool:
    """A failure that a retry would meet again: bad input, or the job running out of its time (rq's
    timeout; the client has given up on the job by then)."""
    return isinstance(exc, JobRejected | JobTimeoutException) or isinstance(exc.__cause__, JobTimeoutException)
