"""The experiment trackers behind `tandem_trainer.tracking.Tracker`, one module per client library;
`open_tracker` picks the one the settings name and puts it behind the trainer's queue (outbox.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tandem_trainer.errors import TrainerConfigError
from tandem_trainer.trackers.outbox import TrackerOutbox

if TYPE_CHECKING:
    from tandem.settings import TrackerSettings
    from tandem_trainer.metrics import TrainerMetrics
    from tandem_trainer.tracking import Tracker

#: Each client library's own reporting home, switched off before it is imported: nothing of the
#: trainer leaves the machine but what goes to the tracker named. MLflow 3 sends usage telemetry
#: unless `MLFLOW_DISABLE_TELEMETRY` (read by `import mlflow`, which starts its client then); W&B
#: reports its own errors (wandb-core's Sentry), offline too, unless `WANDB_ERROR_REPORTING=false`.
TELEMETRY_OFF: dict[str, dict[str, str]] = {
    "mlflow": {"MLFLOW_DISABLE_TELEMETRY": "true"},
    "wandb": {"WANDB_ERROR_REPORTING": "false"},
}


def open_tracker(settings: TrackerSettings, metrics: TrainerMetrics) -> Tracker | None:
    """The tracker `settings.kind` names (None for `none`), behind a queue that a job never waits on and
    that counts its failures and drops in `metrics`; a missing client library is a config error."""
    if settings.kind == "none":
        return None
    os.environ.update(TELEMETRY_OFF[settings.kind])
    tracker: Tracker
    try:
        if settings.kind == "mlflow":
            from tandem_trainer.trackers.mlflow_tracker import MlflowTracker

            tracker = MlflowTracker(settings)
        else:
            from tandem_trainer.trackers.wandb_tracker import WandbTracker

            tracker = WandbTracker(settings)
    except ImportError as exc:
        raise TrainerConfigError(
            f"TANDEM_TRACKER__KIND={settings.kind} but its client library does not import ({exc}); install "
            f"tandem-trainer[{settings.kind}], or set TANDEM_TRACKER__KIND=none"
        ) from exc
    return TrackerOutbox(tracker, settings.kind, metrics)
