"""The dispatch: every kind of job the trainer runs, by name, in one place.

The worker's job function names a kind (worker.py); `Trainer.run` (runner.py) looks it up here
and runs it in the frame every kind shares. A new kind is a module beside `train.py` with a
`JobKind` (base.py), an entry here, and a job function on the queue (see `jobs/__init__.py`).
"""

from __future__ import annotations

from typing import Any

from tandem_trainer.jobs.base import JobKind
from tandem_trainer.jobs.forward_backward import ForwardBackwardKind
from tandem_trainer.jobs.load_state import LoadStateKind
from tandem_trainer.jobs.optim_step import OptimStepKind
from tandem_trainer.jobs.train import TrainKind

#: The `train` kind: one GRPO step from trajectory groups.
TRAIN = TrainKind()
#: Tinker's training calls (tandem.tinker_jobs): gradients held with the run, a step published, a state loaded.
FORWARD_BACKWARD = ForwardBackwardKind()
OPTIM_STEP = OptimStepKind()
LOAD_STATE = LoadStateKind()

#: Every kind, by its name.
KINDS: dict[str, JobKind[Any, Any]] = {kind.name: kind for kind in (TRAIN, FORWARD_BACKWARD, OPTIM_STEP, LOAD_STATE)}
