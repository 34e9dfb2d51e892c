"""Weights & Biases: one W&B run per tandem run, in the project `tracker.experiment`.

Offline by default (`tracker.wandb_mode`): the runs are written under `tracker.wandb_dir`/wandb/
and `wandb sync` uploads them when wanted. The W&B run's id is the tandem run's name, so its
steps stay together. `step_to_serving_s` has its own x-axis, `serving_version` (W&B takes a
step only once, in order, and a version's serving time is known a step or more later).
"""

from __future__ import annotations

import logging
from typing import Any

import wandb

from tandem.events import EventStream
from tandem.jobs import TrainResult
from tandem.runs import RunSpec
from tandem.settings import TrackerSettings
from tandem_trainer.tracking import ServingWatch, run_params, step_metrics

log = logging.getLogger(__name__)


class WandbTracker:
    """Logs each step of each run to Weights & Biases."""

    def __init__(self, settings: TrackerSettings) -> None:
        self.settings = settings
        self.watch = ServingWatch()
        self._runs: dict[str, Any] = {}

    def log_step(self, spec: RunSpec, result: TrainResult, stepped_at: float, events: EventStream) -> None:
        run = self._run(spec)
        run.log(step_metrics(result), step=result.version)
        self.watch.add(spec.name, result.version, stepped_at, result.published_at)
        for version, seconds in sorted(self.watch.served(spec.name, events).items()):
            run.log({"serving_version": version, "step_to_serving_s": seconds}, step=result.version)

    def close(self) -> None:
        for run in self._runs.values():
            run.finish()
        self._runs.clear()

    def _run(self, spec: RunSpec) -> Any:
        if spec.name not in self._runs:
            self.settings.wandb_dir.mkdir(parents=True, exist_ok=True)
            run = wandb.init(
                project=self.settings.experiment, name=spec.name, id=spec.name, dir=str(self.settings.wandb_dir),
                mode=self.settings.wandb_mode, config=run_params(spec), reinit="create_new",
                settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            )
            run.define_metric("step_to_serving_s", step_metric="serving_version")
            log.info("tracker.wandb.run_started run=%s mode=%s dir=%s", spec.name, self.settings.wandb_mode,
                     run.dir)
            self._runs[spec.name] = run
        return self._runs[spec.name]
