"""MLflow: one MLflow run per tandem run, in the experiment `tracker.experiment`, through `MlflowClient`.

The client talks to whatever `tracker.mlflow_uri` names (a tracking server, a database, a file
store). A tandem run's MLflow run carries the tag `tandem.run`; a trainer that restarts finds it
by that tag and logs on into it. The client is used directly, not MLflow's fluent API, so no
process-global "active run" is involved.

MLflow's HTTP client waits 120 s for an answer and retries 7 times with growing pauses: minutes
for one step while a tracking server hangs or is down. The steps are sent from the trainer's
tracker thread (outbox.py), never from a job, but a short bound still matters: a step of an
outage fails, is counted and logged within seconds, and the queue behind it keeps moving.
`HTTP_DEFAULTS` sets MLflow's own variables where the environment does not (an operator's win).
"""

from __future__ import annotations

import logging
import os
import time

from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from tandem.events import EventStream
from tandem.jobs import TrainResult
from tandem.runs import RunSpec
from tandem.settings import TrackerSettings
from tandem_trainer.tracking import ServingWatch, run_params, step_metrics

log = logging.getLogger(__name__)

#: The tag that names a tandem run on its MLflow run.
RUN_TAG = "tandem.run"

#: MLflow's HTTP knobs (read at each request): one attempt of 5 s at most. A step that meets a blip
#: is one point less on the curve; retries would only hold the queue (and log a line each).
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
}


class MlflowTracker:
    """Logs each step of each run to MLflow."""

    def __init__(self, settings: TrackerSettings) -> None:
        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        self.client = MlflowClient(tracking_uri=settings.mlflow_uri)
        self.experiment = settings.experiment
        self.watch = ServingWatch()
        self._experiment_id: str | None = None
        self._runs: dict[str, str] = {}

    def log_step(self, spec: RunSpec, result: TrainResult, stepped_at: float, events: EventStream) -> None:
        run_id = self._run_id(spec)
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, result.version) for key, value in step_metrics(result).items()]
        self.watch.add(spec.name, result.version, stepped_at, result.published_at)
        metrics += [Metric("step_to_serving_s", seconds, now, version)
                    for version, seconds in self.watch.served(spec.name, events).items()]
        self.client.log_batch(run_id, metrics=metrics)

    def close(self) -> None:
        self._runs.clear()

    def _run_id(self, spec: RunSpec) -> str:
        """The MLflow run of `spec`'s tandem run: known, found by its tag, or created."""
        if spec.name in self._runs:
            return self._runs[spec.name]
        experiment_id = self._experiment()
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{spec.name}'",
                                        max_results=1)
        if found:
            run_id = str(found[0].info.run_id)
        else:
            run = self.client.create_run(experiment_id, run_name=spec.name, tags={RUN_TAG: spec.name})
            run_id = str(run.info.run_id)
            params = [Param(key, str(value)) for key, value in run_params(spec).items()]
            self.client.log_batch(run_id, params=params)
            log.info("tracker.mlflow.run_created run=%s mlflow_run_id=%s experiment=%s",
                     spec.name, run_id, self.experiment)
        self._runs[spec.name] = run_id
        return run_id

    def _experiment(self) -> str:
        if self._experiment_id is None:
            existing = self.client.get_experiment_by_name(self.experiment)
            if existing is not None:
                self._experiment_id = existing.experiment_id
            else:
                try:
                    self._experiment_id = self.client.create_experiment(self.experiment)
                except MlflowException:  # another trainer created it meanwhile
                    again = self.client.get_experiment_by_name(self.experiment)
                    if again is None:
                        raise
                    self._experiment_id = again.experiment_id
        return self._experiment_id
