"""What a kind of job is: the dispatch (kinds.py) maps a name to one, the frame (runner.py) runs it.

A kind says how its payload is validated (with the pydantic model that the sending side, in
`tandem`, built it from), what a validated job does (`run`, on the process's `JobContext`),
and what its end line says. The frame does the rest alike for every kind: the `<name>.start`
line, the job metrics, a failure's `<name>.failed` line and `train_failed` event, and
forgetting the version in memory after a failure that is not the input's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel, JsonValue

from tandem_trainer.jobs.context import JobContext

P = TypeVar("P", bound=BaseModel)
"""The kind's payload model."""
R = TypeVar("R", bound=BaseModel)
"""The kind's result model: its JSON form is the rq job's result."""


@dataclass
class Attempt:
    """One attempt at one job, as its log lines and its failure event name it."""

    run: str
    """The run the payload names ('' when it names none), read before the payload is validated."""
    job_id: str | None
    started: float
    """`time.perf_counter()` when the attempt began."""
    version: int | None = None
    """The version the job is to publish, once the kind knows it; its `train_failed` event names it."""


class JobKind(ABC, Generic[P, R]):
    """One kind of job: its payload, its work and its end line."""

    name: str
    """Its key in `kinds.KINDS`, and the first word of its log lines (`train.start`)."""

    @abstractmethod
    def parse(self, payload: BaseModel | JsonValue) -> P:
        """The payload as the kind's model: as it is when it is one, else validated from the JSON
        that the queue carries; raise `ValidationFailed` naming the field."""

    @abstractmethod
    def run(self, ctx: JobContext, job: P, attempt: Attempt) -> R:
        """Do the job; set `attempt.version` once the version it publishes is known."""

    @abstractmethod
    def log_end(self, result: R, attempt: Attempt) -> None:
        """Log the `<name>.end` line of a job that succeeded."""
