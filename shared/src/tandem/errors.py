"""tandem's errors, one tree for the whole light package.

    TandemError
    ├── ConfigError            a setting or argument that cannot work
    ├── ValidationFailed       user data (a job, a run, a trajectory) that breaks a contract
    │   └── JobRefused         a queued job that is not a tandem train job (never run, never retried)
    ├── RunNotFound            a run name the registry does not know
    ├── RunExists              create_run on a name that is taken, with another spec
    ├── AdapterError
    │   ├── AdapterRejected    a version on disk that fails verification (checksum, path, rank)
    │   └── VersionExists      a version that was already published (versions are immutable)
    ├── TrainFailed            a train job that ended with `train_failed`
    ├── TrainTimeout           a train job that did not serve in time
    ├── GatewayError           the gateway answered with an error (status and body kept)
    ├── MalformedEvent         a stream entry that does not parse (skipped by every consumer)
    └── BackendUnavailable     Redis or the gateway cannot be reached

Errors from redis, rq and httpx are translated where they enter tandem, with a message that
names the offending value and what to do.
"""

from __future__ import annotations


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


class AdapterError(TandemError):
    """Something is wrong with an adapter version."""


class AdapterRejected(AdapterError):
    """A version on disk failed verification; the previous version keeps serving."""


class VersionExists(AdapterError):
    """The version was already published; versions are immutable."""


class TrainFailed(TandemError):
    """A train job ended with `train_failed`; the message is the trainer's."""


class TrainTimeout(TandemError):
    """A train job did not reach the server in the allowed time."""


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
