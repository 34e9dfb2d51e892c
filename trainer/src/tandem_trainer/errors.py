"""The trainer's errors, rooted in tandem's tree so callers can catch `TandemError` once.

    TandemError
    └── TrainerError
        ├── JobRejected              bad input (also a ValidationFailed); `field` names it; never retried
        ├── TrainerConfigError       a trainer setting that cannot work (also a ConfigError)
        │   └── TrainingBackendMissing   the torch backend or device asked for cannot run here
        ├── CheckpointError          a version's adapter or optimizer state cannot be read or written
        ├── TrainStepFailed          the step itself failed (out of memory, non-finite loss); may be retried
        │   ├── RankFailed           data-parallel: one rank's share failed; the ranks carry on
        │   └── RanksLost            data-parallel: a rank stopped; torchrun restarts the ranks
        ├── RendezvousFailed         data-parallel nodes: nobody came to the rendezvous in time; the node exits
        ├── LockTimeout              another worker held the run's lock for the whole wait
        └── TinyModelDirTaken        the tiny model's directory holds something else (also a FileExistsError)

The split that matters is JobRejected versus everything else: the same input fails the same
way every time, so a rejected job is failed at once, while other errors are worth a retry.

Errors from torch, peft and the file system are translated where they enter the trainer.
Redis errors are translated where they enter too (`tandem.connection.translated`), into the
light package's `BackendUnavailable`: the trainer raises it, like the light package's other
errors that reach it (`LeaseTimeout` in shared mode, `AdapterRejected` from the store), as
it is. The one module that handles redis-py's own errors is outage.py, which retries them on
the connection while Redis may come back.
"""

from __future__ import annotations

from tandem.errors import ConfigError, TandemError, ValidationFailed


class TrainerError(TandemError):
    """Root of every error the trainer raises on purpose."""


class JobRejected(TrainerError, ValidationFailed):
    """A job whose input cannot be trained on; retrying it cannot help.

    `field` is the dotted path of the offending field (`groups.0.trajectories.1.completion_ids`).
    """


class TrainerConfigError(TrainerError, ConfigError):
    """A trainer setting that cannot work (a worker name in use, an unknown failpoint)."""


class TrainingBackendMissing(TrainerConfigError):
    """The torch backend or device the settings ask for cannot run in this environment.

    Not to be confused with `tandem.errors.BackendUnavailable` (Redis or the gateway down).
    """


class CheckpointError(TrainerError):
    """A version's adapter weights or optimizer state cannot be read or written."""


class TrainStepFailed(TrainerError):
    """The optimisation step failed for a reason other than its input (OOM, non-finite loss)."""


class LockTimeout(TrainerError):
    """The run's lock stayed held by a live worker for longer than the job may wait."""


class TinyModelDirTaken(TrainerError, FileExistsError):
    """The tiny model's directory holds something other than that model; pass overwrite=True."""


class RankFailed(TrainStepFailed):
    """Data-parallel training: a rank's share of the step failed; every rank raises this."""


class RanksLost(TrainStepFailed):
    """Data-parallel training: the ranks can no longer talk (one of them stopped); torchrun
    starts them all again."""


class RendezvousFailed(TrainerError):
    """Data-parallel nodes: the others did not come to the rendezvous, or its store did not answer,
    within `parallel.rendezvous_timeout_s`; the node's trainer exits."""
