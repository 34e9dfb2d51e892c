"""The trainer's errors, rooted in tandem's tree so callers can catch `TandemError` once.

    TandemError
    └── TrainerError
        ├── JobRejected          bad input (also a ValidationFailed); `field` names it; never retried
        ├── BackendNotAvailable  a backend or device that cannot run here (also a ConfigError)
        ├── CheckpointError      a version's adapter or optimizer state cannot be loaded
        ├── TrainStepFailed      the step itself failed (out of memory, non-finite loss); may be retried
        └── LockTimeout          another worker held the run's lock for the whole wait

The split that matters is JobRejected versus everything else: the same input fails the same
way every time, so a rejected job is failed at once, while other errors are worth a retry.
Errors from torch, peft and rq are translated where they enter the trainer.
"""

from __future__ import annotations

from tandem.errors import ConfigError, TandemError, ValidationFailed


class TrainerError(TandemError):
    """Root of every error the trainer raises on purpose."""


class JobRejected(TrainerError, ValidationFailed):
    """A job whose input cannot be trained on; retrying it cannot help.

    `field` is the dotted path of the offending field (`groups.0.trajectories.1.completion_ids`).
    """


class BackendNotAvailable(TrainerError, ConfigError):
    """The configured backend or device cannot run in this environment."""


class CheckpointError(TrainerError):
    """A published version's adapter weights or optimizer state cannot be loaded."""


class TrainStepFailed(TrainerError):
    """The optimisation step failed for a reason other than its input (OOM, non-finite loss)."""


class LockTimeout(TrainerError):
    """The run's lock stayed held by a live worker for longer than the job may wait."""
