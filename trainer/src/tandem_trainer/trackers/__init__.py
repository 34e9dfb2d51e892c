"""The experiment trackers behind `tandem_trainer.tracking.Tracker`, one module per client library."""
