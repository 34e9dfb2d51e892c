"""What the Tinker kinds (forward_backward, optim_step, load_state) share.

A Tinker model is a tandem run, trained by its calls in order: `forward_backward` accumulates
gradients that stay in this trainer's memory with the run (the backend's `gradient_jobs`, set
aside with the run when another run trains: backends/resident.py), and `optim_step` applies
them and publishes the run's next version. The gradients live in one process, so:

- these kinds run on a trainer of one process: with data-parallel ranks every rank would need
  the same gradients, which the ranks do not keep between jobs; such a trainer refuses them
  (`single_process`), never retried;
- a run's Tinker calls must reach the trainer that holds its gradients: with several trainer
  workers on one queue, an `optim_step` taken by another worker (or by this one after it
  restarted) finds none and is refused, naming the jobs whose gradients are not held;
- any job that fails for a reason other than its input invalidates the backend (runner.py),
  which drops every run's held gradients (logged as `gradients.dropped` / `resident.drop`).
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, JsonValue, ValidationError

from tandem.errors import invalid
from tandem.runs import RunSpec
from tandem_trainer.errors import JobRejected
from tandem_trainer.jobs.context import JobContext
from tandem_trainer.jobs.versions import resume_point

M = TypeVar("M", bound=BaseModel)


def parsed(model: type[M], payload: BaseModel | JsonValue, what: str) -> M:
    """The payload as `model`: as it is when it is one, else validated; JobRejected names the field."""
    if isinstance(payload, model):
        return payload
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        failure = invalid(f"invalid {what} job", exc)
        raise JobRejected(str(failure), field=failure.field) from exc


def single_process(ctx: JobContext, kind: str) -> None:
    """Refuse a Tinker kind on a trainer of several data-parallel ranks (see the module's docstring)."""
    if ctx.group is not None and ctx.group.world > 1:
        raise JobRejected(
            f"{kind}: this trainer has {ctx.group.world} data-parallel ranks, and Tinker's calls keep "
            "gradients in one process between jobs; serve Tinker models from a trainer of one process "
            "(parallel.ranks=1)", field="run")


def activate_newest(ctx: JobContext, spec: RunSpec) -> tuple[int, int]:
    """Make the run's newest intact version the training adapter (a fresh one at version 0), its
    held gradients with it; returns (the newest registered version, the version activated). Call
    with the run's lock and the device held."""
    latest = ctx.registry.latest_version(spec.name)
    parent = resume_point(ctx, spec.name, latest)
    ctx.backend.activate(spec, parent, ctx.store.version_dir(spec.name, parent) if parent else None)
    return latest, parent
