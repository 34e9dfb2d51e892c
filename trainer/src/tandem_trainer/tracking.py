"""Each run's learning curve in an experiment tracker: MLflow or Weights & Biases.

`TANDEM_TRACKER__KIND` picks one for the trainer (`TrackerSettings` in tandem.settings.trainer);
every tandem run becomes one tracker run of the same name, found again by a trainer that
restarts, with the run spec's LoRA, optimizer and loss settings as its parameters. After each job
that trained, the trainer logs that step, at the version it published (one optimizer step per
version, so the x-axis counts the run's steps): the step's reward mean and std, the mean of the
groups' reward std (the signal GRPO sees), loss, KL, entropy, clip fraction, gradient norm,
tokens, time, the versions that sampled the rollouts and their staleness.

`step_to_serving_s`, the time from a version's optimizer step to the inference side serving it
(its `adapter_loaded` event), is known only once the controller has loaded it: each step looks
for the versions still waiting in the event stream and logs what it finds at their own step.

Each tracker's client library is an optional extra (`tandem-trainer[mlflow]`,
`tandem-trainer[wandb]`), imported only when chosen (`tandem_trainer.trackers.open_tracker`).
A job never waits on its tracker: it queues the step, and a thread of the trainer sends it
(`tandem_trainer.trackers.outbox`); a step the tracker could not take, or that found the queue
full, is skipped, logged and counted, and the curve goes on once the tracker answers again.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.events import EventKind, EventStream
from tandem.jobs import TrainResult
from tandem.runs import RunSpec

log = logging.getLogger(__name__)

#: The manifest's metrics (jobs/train.py) a tracker logs, under the same names.
LOGGED = (
    "loss", "approx_kl", "ref_kl", "entropy", "clip_frac", "ratio_mean", "grad_norm", "reward_mean", "reward_std",
    "reward_group_std", "zero_advantage_groups", "staleness_mean", "staleness_max", "rollout_version_min",
    "rollout_version_max", "tokens", "sequences", "microbatches", "train_s", "gpu_wait_s",
)

#: How many published versions a tracker keeps looking for in the event stream before it gives up.
PENDING_VERSIONS = 8


class Tracker(Protocol):
    """Where a run's steps go."""

    def log_step(self, spec: RunSpec, result: TrainResult, stepped_at: float, events: EventStream) -> None:
        """Log the step that published `result.version` (its optimizer step done at `stepped_at`)."""

    def close(self) -> None:
        """Flush and let go of every tracker run."""


def step_metrics(result: TrainResult) -> dict[str, float]:
    """The numbers logged for the step that published `result` (finite ones only)."""
    out = {key: float(result.metrics[key]) for key in LOGGED if key in result.metrics}
    if result.train_s > 0 and "tokens" in out:
        out["tokens_per_s"] = out["tokens"] / result.train_s
    out["version"] = float(result.version)
    out["step"] = float(result.step)
    return {k: v for k, v in out.items() if math.isfinite(v)}


@dataclass
class ServingWatch:
    """Versions published but not yet seen served, per run: their step → serving time, once known."""

    pending: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    """run → version → (optimizer step's wall time, publish time)."""

    def add(self, run: str, version: int, stepped_at: float, published_at: float) -> None:
        versions = self.pending.setdefault(run, {})
        versions[version] = (stepped_at, published_at)
        for old in sorted(versions)[:-PENDING_VERSIONS]:
            del versions[old]

    def served(self, run: str, events: EventStream) -> dict[int, float]:
        """version → seconds from its optimizer step to its first `adapter_loaded`, for every
        pending version of `run` that the event stream shows served (they stop being pending)."""
        versions = self.pending.get(run, {})
        if not versions:
            return {}
        since = min(published for _, published in versions.values()) - 1.0
        found: dict[int, float] = {}
        for event in events.since(since):
            if (event.kind is EventKind.ADAPTER_LOADED and event.run == run and event.version in versions
                    and event.version not in found):
                found[event.version] = max(0.0, event.ts - versions[event.version][0])
        for version in found:
            del versions[version]
        return found


def run_params(spec: RunSpec) -> dict[str, Any]:
    """The run spec's settings as flat `section.field` parameters (LoRA, optimizer, loss, model)."""
    params: dict[str, Any] = {"base_model": spec.base_model, "max_staleness_steps": spec.max_staleness_steps}
    for section in ("lora", "optimizer", "loss"):
        for key, value in getattr(spec, section).model_dump(mode="json").items():
            params[f"{section}.{key}"] = value
    return params
