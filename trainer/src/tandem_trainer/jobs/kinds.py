"""The dispatch: every kind of job the trainer runs, by name, in one place.

The worker's job function names a kind (worker.py); `Trainer.run` (runner.py) looks it up here
and runs it in the frame every kind shares. A new kind is a module beside `train.py` with a
`JobKind` (base.py), an entry here, and a job function on the queue (see `jobs/__init__.py`).
"""

from __future__ import annotations

from typing import Any

from tandem_trainer.jobs.base import JobKind
from tandem_trainer.jobs.train import TrainKind

#: The `train` kind: one GRPO step from trajectory groups.
TRAIN = TrainKind()

#: Every kind, by its name.
KINDS: dict[str, JobKind[Any, Any]] = {kind.name: kind for kind in (TRAIN,)}
