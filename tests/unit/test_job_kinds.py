"""The trainer's dispatch of jobs: every kind is one registered `JobKind`, and the job function the
queue names (`tandem.jobs.TRAIN_FUNC`, a contract with jobs already queued) is still there.

No Redis, no model: the modules of `tandem_trainer.jobs` are imported and the registry read.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import tandem_trainer.jobs
from tandem.jobs import JOB_FUNCS, TRAIN_FUNC
from tandem_trainer.jobs.base import JobKind
from tandem_trainer.jobs.kinds import KINDS, TRAIN
from tandem_trainer.jobs.train import TrainKind

pytestmark = pytest.mark.unit


def _kind_classes() -> set[type]:
    """Every concrete JobKind defined in a module of the jobs package."""
    found: set[type] = set()
    for info in pkgutil.iter_modules(tandem_trainer.jobs.__path__, "tandem_trainer.jobs."):
        module = importlib.import_module(info.name)
        found |= {cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, JobKind) and not inspect.isabstract(cls) and cls.__module__ == info.name}
    return found


def test_each_kind_is_registered_once_under_its_own_name() -> None:
    assert all(isinstance(kind, JobKind) and kind.name == name for name, kind in KINDS.items())
    assert {type(kind) for kind in KINDS.values()} == _kind_classes()
    assert len({type(kind) for kind in KINDS.values()}) == len(KINDS)


def test_the_train_kind_is_registered_and_the_queues_job_function_exists() -> None:
    assert KINDS["train"] is TRAIN and isinstance(TRAIN, TrainKind)
    module, _, function = TRAIN_FUNC.rpartition(".")
    assert callable(getattr(importlib.import_module(module), function))


def test_every_job_function_the_guard_allows_exists_and_runs_a_registered_kind() -> None:
    import tandem_trainer.worker as worker

    assert set(KINDS) == {"train", "forward_backward", "optim_step", "load_state"}
    for func in JOB_FUNCS:
        module, _, function = func.rpartition(".")
        assert module == "tandem_trainer.worker" and callable(getattr(worker, function))
        assert function.removeprefix("run_").removesuffix("_job") in KINDS
