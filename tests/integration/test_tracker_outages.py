"""A tracker that hangs or is down costs only its curve: the real MLflow client, behind the trainer's
tracker queue, against a tracking server on loopback that this test controls (it answers the MLflow
REST calls the tracker makes, hangs on demand, or is not there at all)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import redis
from helpers.loopback import free_port
from helpers.waiting import wait_until

from tandem.events import EventStream
from tandem.jobs import TrainResult
from tandem.runs import RunSpec
from tandem.settings import TrackerSettings
from tandem_trainer.metrics import TrainerMetrics
from tandem_trainer.trackers import open_tracker
from tandem_trainer.tracking import Tracker

pytestmark = pytest.mark.integration

RUN = "outage-run"
#: Longer than MLflow's own defaults would take to give up on a hung server (120 s, 7 retries).
HANG_S = 300.0


class TrackingServer(ThreadingHTTPServer):
    """MLflow's tracking REST API as far as the tracker uses it (one experiment, one run), on loopback.

    While `answering` is clear, every request is read and then held without an answer (a server
    that hangs) until it is set. `batches` are the metrics of every log-batch it answered.
    """

    daemon_threads = True

    def __init__(self, port: int) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.answering = threading.Event()
        self.answering.set()
        self.experiment: str | None = None
        self.run_created = False
        self.batches: list[list[dict[str, Any]]] = []

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A held request whose client gave up meets a closed socket: nothing to report."""

    def steps_logged(self, key: str = "loss") -> set[int]:
        return {int(m["step"]) for batch in self.batches for m in batch if m["key"] == key}


class Handler(BaseHTTPRequestHandler):
    server: TrackingServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(None)

    def do_POST(self) -> None:  # noqa: N802
        self._answer(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}"))

    def _answer(self, body: dict[str, Any] | None) -> None:
        server = self.server
        server.answering.wait(HANG_S)
        url = urlsplit(self.path)
        route = url.path.removeprefix("/api/2.0/mlflow/")
        experiment = {"experiment_id": "1", "name": server.experiment, "lifecycle_stage": "active"}
        run = {"info": {"run_id": "r1", "experiment_id": "1", "run_name": RUN, "status": "RUNNING",
                        "lifecycle_stage": "active"}, "data": {"tags": [{"key": "tandem.run", "value": RUN}]}}
        if route == "experiments/get-by-name":
            if server.experiment != parse_qs(url.query).get("experiment_name", [""])[0]:
                return self._send(404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"})
            return self._send(200, {"experiment": experiment})
        assert body is not None, self.path
        if route == "experiments/create":
            server.experiment = body["name"]
            return self._send(200, {"experiment_id": "1"})
        if route == "runs/search":
            return self._send(200, {"runs": [run]} if server.run_created else {})
        if route == "runs/create":
            server.run_created = True
            return self._send(200, {"run": run})
        if route == "runs/log-batch":
            server.batches.append(body.get("metrics", []))
            return self._send(200, {})
        self._send(404, {"error_code": "ENDPOINT_NOT_FOUND", "message": self.path})

    def _send(self, status: int, reply: dict[str, Any]) -> None:
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def tracking_server(port: int, *, hanging: bool = False) -> Iterator[TrackingServer]:
    server = TrackingServer(port)
    if hanging:
        server.answering.clear()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.answering.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def mlflow_tracker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Opens the trainer's MLflow tracker (queue and all) for a URL; the environment it sets is undone after."""
    for name in ["MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_DISABLE_TELEMETRY"]:
        monkeypatch.delenv(name, raising=False)  # MLflow's defaults are the trainer's to set
    opened: list[Tracker] = []

    def open_for(url: str) -> tuple[Tracker, TrainerMetrics]:
        metrics = TrainerMetrics()
        tracker = open_tracker(TrackerSettings(kind="mlflow", mlflow_uri=url, experiment="outages"), metrics)
        assert tracker is not None
        opened.append(tracker)
        return tracker, metrics

    yield open_for
    for tracker in opened:
        tracker.close()


def step(tracker: Tracker, conn: redis.Redis, version: int) -> float:
    """Hand the tracker the step that published `version`, as a job does; the seconds that took."""
    result = TrainResult(job_id=f"job-{version}", run=RUN, step=version, version=version, parent=version - 1,
                         metrics={"loss": 0.5 / version, "reward_mean": 0.1 * version}, train_s=1.0,
                         published_at=time.time())
    t0 = time.monotonic()
    tracker.log_step(RunSpec(name=RUN, base_model="tiny"), result, time.time(), EventStream(conn))
    return time.monotonic() - t0


def errors(metrics: TrainerMetrics) -> float:
    return metrics.registry.get_sample_value("tandem_trainer_tracker_errors_total") or 0.0


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_a_hung_tracking_server_holds_no_step_and_the_curve_resumes(mlflow_tracker, redis_conn,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tandem_trainer")
    with tracking_server(free_port(), hanging=True) as server:
        tracker, metrics = mlflow_tracker(f"http://127.0.0.1:{server.server_port}")
        started = time.monotonic()
        assert step(tracker, redis_conn, 1) < 5  # the server holds the request for HANG_S

        # MLflow's client gives up within seconds (the trainer's bound), not after minutes
        wait_until(lambda: errors(metrics) == 1, 60, "the failed step to be counted")
        assert time.monotonic() - started < 60
        [failed] = warnings_about(caplog, "tracker.failed")
        assert f"tracker.failed run={RUN} version=1 kind=mlflow error=MlflowException" in failed
        assert "the curve skips this step" in failed

        server.answering.set()  # the tracking server is back: the curve goes on
        assert step(tracker, redis_conn, 2) < 5
        wait_until(lambda: 2 in server.steps_logged(), 60, "step 2 to reach the tracking server")
        assert any("tracker.recovered kind=mlflow failed=1" in r.getMessage() for r in caplog.records)
        tracker.close()
        assert errors(metrics) == 1


def test_a_tracking_server_that_is_down_holds_no_step_and_the_curve_resumes(mlflow_tracker, redis_conn,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tandem_trainer")
    port = free_port()  # nothing listens: connections are refused
    tracker, metrics = mlflow_tracker(f"http://127.0.0.1:{port}")
    assert step(tracker, redis_conn, 1) < 5
    wait_until(lambda: errors(metrics) == 1, 60, "the failed step to be counted")
    assert warnings_about(caplog, f"tracker.failed run={RUN} version=1 kind=mlflow")

    with tracking_server(port) as server:
        assert step(tracker, redis_conn, 2) < 5
        assert step(tracker, redis_conn, 3) < 5
        wait_until(lambda: {2, 3} <= server.steps_logged(), 60, "steps 2 and 3 to reach the tracking server")
        assert server.steps_logged() == {2, 3}  # step 1 is the outage's only cost
        tracker.close()
    assert errors(metrics) == 1
