"""tandem's errors, one tree for the whole light package.

    TandemError
    ├── ConfigError            a setting or argument that cannot work
    ├── ValidationFailed       data that breaks a contract (a job, a run, a group, a Redis value)
    │   └── JobRefused         a queued job that is not a tandem train job (never run, never retried)
    ├── RunNotFound            a run name the registry does not know
    ├── RunExists              create_run on a name that is taken, with another spec (or a
    │                          deleted run's, until the trainer removed its versions)
    ├── RunBusy                deleting a run while a job of it runs (the job is named)
    ├── RunQueueFull           a run's jobs on the train queue stayed at its quota past the wait
    ├── AdapterError
    │   ├── AdapterRejected    a version on disk that fails verification (checksum, path, rank)
    │   │   └── AdapterNotVisible  its directory or files are not there (yet): retried, never final
    │   └── VersionExists      a version that was already published (versions are immutable)
    ├── TrainFailed            a train job that ended with `train_failed`
    ├── TrainTimeout           a train job that did not serve in time
    ├── GatewayError           the gateway answered with an error (status and body kept)
    ├── MalformedEvent         a stream entry that does not parse (skipped by every consumer)
    ├── LeaseTimeout           shared mode: inference did not hand over the GPU in time
    ├── StackError             a service of the local stack (`tandem up`) did not start
    └── BackendUnavailable     Redis or the gateway cannot be reached

Errors from redis, rq and httpx are translated where they enter tandem, with a message that
names the offending value and what to do; pydantic's, for data that breaks a contract, with
`invalid` (the message names each offending field).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class TandemError(Exception):
    """Root of every error tandem raises on purpose."""


class ConfigError(TandemError):
    """A setting or an argument that cannot work; the message names it."""


class ValidationFailed(TandemError):
    """User data that breaks a contract; `field` names the offending field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class JobRefused(ValidationFailed):
    """A job on the train queue that names another function, a callback or a webhook, or that
    rq cannot read: the trainer refuses it without running anything."""


class RunNotFound(TandemError):
    """A run name that the registry does not know."""


class RunExists(TandemError):
    """A run of this name exists with a different spec."""


class RunBusy(TandemError):
    """A run that cannot be deleted now: a job of it runs (`job_id`, None when only the run's lock
    names its holder), or the train queue kept changing under the deletion."""

    def __init__(self, message: str, *, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class RunQueueFull(TandemError):
    """A job that waited `queue_wait_s` for its run to have fewer than its quota of jobs on the train
    queue (tandem.job_quota), and still found it full: no trainer took the run's jobs meanwhile."""


class AdapterError(TandemError):
    """Something is wrong with an adapter version."""


class AdapterRejected(AdapterError):
    """A version on disk failed verification; the previous version keeps serving."""


class AdapterNotVisible(AdapterRejected):
    """A version's directory, manifest or files are not in the store (yet). A store shared over
    NFS or a cloud filestore may show a new version late, so this refusal is transient: the
    controller tries the version again with backoff, unlike a checksum or confinement failure."""


class VersionExists(AdapterError):
    """The version was already published; versions are immutable."""


class TrainFailed(TandemError):
    """A train job ended with `train_failed`; the message is the trainer's, and `field` names the
    part of the job it refused (`groups.0.trajectories.3.completion_ids`), None when no one part.
    `submitted`: a `train()` that raised an earlier job's failure had submitted its own
    job first, pending: its `tandem.TrainHandle` (else None)."""

    def __init__(self, message: str, *, field: str | None = None, submitted: object = None) -> None:
        super().__init__(message)
        self.field = field
        self.submitted = submitted


class TrainTimeout(TandemError):
    """A train job did not reach the server in the allowed time. `running`: the trainer had started
    it, so it may still publish a version (wait on it again rather than submitting it again); a job
    that had not started is cancelled. `job_id` and `handle` (a `tandem.TrainHandle`): the job that
    timed out, to wait on again with `handle.result()` (a `train()` that waited returns no handle
    otherwise); one that timed out behind an earlier job of the run is the job it submitted.
    `submitted`: as TrainFailed's, when a `train()` raised an earlier job's timeout."""

    def __init__(self, message: str, *, running: bool = False, job_id: str | None = None,
                 handle: object = None, submitted: object = None) -> None:
        super().__init__(message)
        self.running = running
        self.job_id = job_id
        self.handle = handle
        self.submitted = submitted


class GatewayError(TandemError):
    """The gateway answered with an error status."""

    def __init__(self, message: str, *, status_code: int, body: object = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


class BackendUnavailable(TandemError):
    """Redis or the gateway cannot be reached."""


class MalformedEvent(TandemError):
    """A stream entry that does not parse; consumers log it and read on past it."""

    def __init__(self, entry_id: str, reason: str) -> None:
        super().__init__(f"entry {entry_id}: {reason}")
        self.entry_id = entry_id
        self.reason = reason


class LeaseTimeout(TandemError):
    """Shared mode: the inference side did not hand over the GPU in time."""


class StackError(TandemError):
    """A service of the local stack did not start; the message names it and its log."""


def describe(exc: ValidationError) -> str:
    """pydantic's problems, one part per problem, each naming its field path."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<whole>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def invalid(what: str, exc: ValidationError) -> ValidationFailed:
    """The ValidationFailed to raise from pydantic's `exc`: `what`, then `describe(exc)`; `field` is
    the dotted path of the first problem (None when it concerns the whole object)."""
    errors = exc.errors()
    field = ".".join(str(x) for x in errors[0]["loc"]) if errors and errors[0]["loc"] else None
    return ValidationFailed(f"{what}: {describe(exc)}", field=field)
