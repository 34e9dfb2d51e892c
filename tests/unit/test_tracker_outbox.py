"""The trainer's tracker queue (trackers/outbox.py): a job never waits on its tracker; failures and drops
are counted and logged without a line per step; the curve goes on once the tracker does; shutdown is
bounded. And the trackers' client libraries report nothing home."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tandem.jobs import TrainResult
from tandem.runs import RunSpec
from tandem_trainer.metrics import TrainerMetrics
from tandem_trainer.trackers.outbox import Repeats, TrackerOutbox, since

pytestmark = pytest.mark.unit

SPEC = RunSpec(name="r", base_model="m")


class Recording:
    """A tracker that keeps the versions it is given; it holds each step while `open` is clear, and
    fails while `failing` is set."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.failing = False
        self.closed = False

    def log_step(self, spec: RunSpec, result: TrainResult, stepped_at: float, events: Any) -> None:
        self.entered.set()
        self.open.wait(60)
        if self.failing:
            raise ConnectionError(f"tracking server down\nat version {result.version}")
        self.versions.append(result.version)

    def close(self) -> None:
        self.closed = True


def send(outbox: TrackerOutbox, version: int) -> float:
    """Hand the outbox a step as the job does; the seconds it took."""
    result = TrainResult(job_id=f"j{version}", run="r", step=version, version=version, parent=version - 1,
                         metrics={"loss": 1.0})
    t0 = time.monotonic()
    outbox.log_step(SPEC, result, time.time(), None)  # type: ignore[arg-type] - the tracker reads no events
    return time.monotonic() - t0


def counted(metrics: TrainerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"tandem_trainer_tracker_{name}_total") or 0.0


def lines(caplog: pytest.LogCaptureFixture, event: str, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.getMessage().startswith(event)]


def wait(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_tracker_that_hangs_holds_no_job_and_a_full_queue_drops(caplog: pytest.LogCaptureFixture) -> None:
    tracker, metrics = Recording(), TrainerMetrics()
    tracker.open.clear()
    outbox = TrackerOutbox(tracker, "fake", metrics, capacity=2)
    assert send(outbox, 1) < 5
    assert tracker.entered.wait(30)  # step 1 is with the tracker, which holds it
    assert max(send(outbox, version) for version in (2, 3, 4, 5)) < 5
    assert counted(metrics, "dropped") == 2  # 2 and 3 wait in the queue; 4 and 5 find it full
    [dropped] = lines(caplog, "tracker.dropped")  # the second drop is held back
    assert dropped.startswith("tracker.dropped run=r version=4 kind=fake: 2 steps wait")
    assert "the curve skips this step" in dropped

    tracker.open.set()
    outbox.close()
    assert tracker.versions == [1, 2, 3] and tracker.closed


def test_failures_are_counted_logged_once_per_outage_and_the_curve_resumes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tandem_trainer")
    tracker, metrics = Recording(), TrainerMetrics()
    tracker.failing = True
    outbox = TrackerOutbox(tracker, "fake", metrics)
    for version in range(1, 6):
        send(outbox, version)
    wait(lambda: counted(metrics, "errors") == 5, "five failures")
    [failed] = lines(caplog, "tracker.failed")
    assert failed == ("tracker.failed run=r version=1 kind=fake error=ConnectionError message=tracking server down "
                      "at version 1: the curve skips this step, training goes on")
    assert len(lines(caplog, "tracker.failed", logging.DEBUG)) == 5  # each with its traceback

    tracker.failing = False
    send(outbox, 6)
    wait(lambda: tracker.versions == [6], "step 6 to reach the tracker")
    assert lines(caplog, "tracker.recovered", logging.INFO) == [
        "tracker.recovered kind=fake failed=5: the curve goes on from run=r version=6"]

    tracker.failing = True  # a second outage is told at once
    send(outbox, 7)
    wait(lambda: len(lines(caplog, "tracker.failed")) == 2, "the second outage's line")
    outbox.close()
    assert counted(metrics, "errors") == 6 and counted(metrics, "dropped") == 0


def test_a_repeated_warning_is_said_once_per_window_with_the_count_held_back() -> None:
    repeats = Repeats(every_s=60)
    assert repeats.due(1000.0) == 0  # the first: at once
    assert repeats.due(1001.0) is None and repeats.due(1059.0) is None
    assert repeats.due(1060.0) == 2  # a minute on: said, with the two held back
    assert repeats.due(1061.0) is None
    repeats.reset()  # the trouble ended: the next one is said at once
    assert repeats.due(1062.0) == 0
    assert since(2, "failed") == " (2 more failed since the last line)" and since(0, "failed") == ""


def test_shutdown_sends_what_is_queued_within_its_bound(caplog: pytest.LogCaptureFixture) -> None:
    tracker, metrics = Recording(), TrainerMetrics()
    outbox = TrackerOutbox(tracker, "fake", metrics)
    for version in (1, 2, 3):
        send(outbox, version)
    outbox.close()
    assert tracker.versions == [1, 2, 3] and tracker.closed

    hung, metrics = Recording(), TrainerMetrics()
    hung.open.clear()
    outbox = TrackerOutbox(hung, "fake", metrics, drain_s=0.5)
    for version in (1, 2, 3):
        send(outbox, version)
    assert hung.entered.wait(30)
    t0 = time.monotonic()
    outbox.close()
    assert time.monotonic() - t0 < 10  # the tracker holds step 1 for up to 60 s
    assert counted(metrics, "dropped") == 2
    assert lines(caplog, "tracker.drain_timeout") == [
        "tracker.drain_timeout kind=fake dropped=2: the tracker did not take the queued steps and close within 0 s; "
        "the curve misses the steps dropped"]
    assert send(outbox, 4) < 5 and counted(metrics, "dropped") == 3  # a step after close is dropped
    hung.open.set()


TELEMETRY = """
from tandem.settings import TrackerSettings
from tandem_trainer.metrics import TrainerMetrics
from tandem_trainer.trackers import open_tracker

for kind in ("mlflow", "wandb"):
    open_tracker(TrackerSettings(kind=kind, mlflow_uri="http://127.0.0.1:9"), TrainerMetrics())

from mlflow.telemetry import get_telemetry_client
import wandb.env

print(get_telemetry_client() is None, wandb.env.error_reporting_enabled())
"""


def test_the_trackers_client_libraries_report_nothing_home(tmp_path) -> None:
    """MLflow sends usage telemetry and W&B its errors unless told not to; the trainer tells them. (Both
    stay quiet under a CI or a test runner's variables, so the check runs without them.)"""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", TELEMETRY], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["True", "False"], out.stderr[-4000:]
