"""The experiment trackers behind `tandem_trainer.tracking.Tracker`, one module per client library;
`open_tracker` picks the one the settings name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem_trainer.errors import TrainerConfigError

if TYPE_CHECKING:
    from tandem.settings import TrackerSettings
    from tandem_trainer.tracking import Tracker


def open_tracker(settings: TrackerSettings) -> Tracker | None:
    """The tracker `settings.kind` names (None for `none`); a missing client library is a config error."""
    if settings.kind == "none":
        return None
    try:
        if settings.kind == "mlflow":
            from tandem_trainer.trackers.mlflow_tracker import MlflowTracker

            return MlflowTracker(settings)
        from tandem_trainer.trackers.wandb_tracker import WandbTracker

        return WandbTracker(settings)
    except ImportError as exc:
        raise TrainerConfigError(
            f"TANDEM_TRACKER__KIND={settings.kind} but its client library does not import ({exc}); install "
            f"tandem-trainer[{settings.kind}], or set TANDEM_TRACKER__KIND=none"
        ) from exc
