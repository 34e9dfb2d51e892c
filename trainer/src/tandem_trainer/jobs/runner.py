"""The frame every job runs in, whatever its kind: validate, run the kind, report how it ended.

`Trainer` is the process's `JobContext` (the resident model, store and Redis) that runs jobs.
The queue carries a job's payload as JSON; the frame validates it once, with the kind's pydantic
model (a caller that holds the model passes it as it is), and a payload that does not validate
is rejected naming the field. Then the kind does its work (kinds.py). Every job logs a
`<kind>.start` line and, as it ends, the kind's `<kind>.end` line or a `<kind>.failed` line with
a `train_failed` event, and counts in the job metrics. A failure that is not the input's, nor a
wait for the run's lock or the GPU that ran out (`UNTOUCHED`), leaves the backend's version in
memory untrusted (partial gradients, a half-done step): it is forgotten on every rank, to be
loaded again by the next job, and the gradients any run held are dropped with it.
"""

from __future__ import annotations

import logging
import time

from pydantic import BaseModel, JsonValue

from tandem.errors import LeaseTimeout, ValidationFailed
from tandem.events import Event, EventKind
from tandem.jobs import TrainJob, TrainResult
from tandem_trainer.errors import JobRejected, LockTimeout
from tandem_trainer.jobs.base import Attempt, JobKind, P, R
from tandem_trainer.jobs.context import JobContext
from tandem_trainer.jobs.failures import names, not_retried, translate
from tandem_trainer.jobs.kinds import KINDS, TRAIN

log = logging.getLogger(__name__)

#: Failures that leave the backend as it was (bad input; the run's lock or the GPU lease never
#: came): memory is still trusted, and the gradients runs hold (Tinker's forward_backward) stay.
UNTOUCHED = (JobRejected, LockTimeout, LeaseTimeout)


class Trainer(JobContext):
    """Runs jobs of every kind against one backend (the resident model), store and Redis."""

    def train(self, payload: TrainJob | JsonValue, *, retries_left: int = 0,
              job_id: str | None = None) -> TrainResult:
        """Train one GRPO step (the `train` kind), or find what the job already published."""
        return self._perform(TRAIN, payload, retries_left=retries_left, job_id=job_id)

    def run(self, kind: str, payload: BaseModel | JsonValue, *, retries_left: int = 0,
            job_id: str | None = None) -> BaseModel:
        """Run one job of the kind named `kind` (a key of `kinds.KINDS`); raise JobRejected on bad input.

        `payload` is the kind's model, or its JSON form as the queue carries it. `retries_left` is
        how often the queue will run the job again if it fails for a reason other than its
        input; it goes into the `train_failed` event so that a client can tell a final
        failure from one that a retry may still fix. `job_id` (the queue's id of the job)
        names the job in that event when the payload does not.
        """
        result: BaseModel = self._perform(KINDS[kind], payload, retries_left=retries_left, job_id=job_id)
        return result

    def _perform(self, kind: JobKind[P, R], payload: BaseModel | JsonValue, *, retries_left: int,
                 job_id: str | None) -> R:
        self.forget_deleted()  # what the backend held of runs deleted since the last job
        started = time.perf_counter()
        attempt = Attempt(*names(payload, job_id), started=started)
        log.info("%s.start run=%s job_id=%s", kind.name, attempt.run, attempt.job_id)
        self.metrics.in_progress.set(1)
        try:
            job = self._validated(kind, payload)
            result = kind.run(self, job, attempt)
        except Exception as exc:
            if not isinstance(exc, UNTOUCHED):
                self.invalidate()  # partial gradients or a half-done step: reload next time
            failure = translate(exc)
            self._failed(kind, attempt, failure, retries_left=0 if not_retried(exc) else retries_left)
            if failure is exc:
                raise
            raise failure from exc
        finally:
            self.metrics.in_progress.set(0)
            self.metrics.job_seconds.observe(time.perf_counter() - started)
        kind.log_end(result, attempt)
        return result

    @staticmethod
    def _validated(kind: JobKind[P, R], payload: BaseModel | JsonValue) -> P:
        """The payload validated with the kind's model (pydantic: the sending side built it with the same)."""
        try:
            return kind.parse(payload)
        except ValidationFailed as exc:
            raise JobRejected(str(exc), field=exc.field) from exc

    def _failed(self, kind: JobKind[P, R], attempt: Attempt, failure: Exception, *, retries_left: int) -> None:
        """The failure's `<kind>.failed` line and its `train_failed` event."""
        field = failure.field if isinstance(failure, ValidationFailed) else None
        log.warning(
            "%s.failed run=%s job_id=%s duration_s=%.3f field=%s error=%s message=%s",
            kind.name, attempt.run, attempt.job_id, time.perf_counter() - attempt.started, field,
            type(failure).__name__,
            " ".join(str(failure).splitlines()),  # one event, one line (a hub error spans several)
        )
        self.events.append(Event(
            kind=EventKind.TRAIN_FAILED, run=attempt.run, version=attempt.version, job_id=attempt.job_id,
            data={"message": str(failure), "field": field, "retries_left": retries_left},
        ))
