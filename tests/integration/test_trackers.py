"""Run curves in the experiment trackers: the real worker, a few real steps on the tiny model, and
the curves read back through each tracker's own files or client (a real `mlflow server`)."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.jobs import RUN, make_job, status
from helpers.loopback import free_port, served_process
from helpers.workers import WorkerProcess, wait_for
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem.events import Event, EventKind, EventStream
from tandem.jobs import TrainResult, enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, RunSpec

pytestmark = pytest.mark.integration

STEPS = 3
CURVES = ("loss", "approx_kl", "ref_kl", "entropy", "grad_norm", "reward_mean", "reward_std", "reward_group_std",
          "staleness_max", "rollout_version_max")


def train_steps(conn: redis.Redis, worker: WorkerProcess, tiny_model: Path) -> tuple[list[TrainResult], float]:
    """STEPS jobs one after the other, each on rollouts of the version before; after the first,
    `adapter_loaded` for v1 as the controller appends it once v1 serves. Returns the results
    and the seconds from v1's step to that event."""
    Registry(conn).create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4),
                                      loss=LossConfig(kl_coef=0.05)))
    results, served_after = [], 0.0
    for step in range(1, STEPS + 1):
        enqueue(conn, make_job(f"job-{step}", step=step, version=step - 1, seed=step))
        wait_for(lambda s=step: status(conn, f"job-{s}") == JobStatus.FINISHED, 90, f"job {step}", worker)
        results.append(TrainResult.model_validate(
            Job.fetch(f"job-{step}", connection=conn, serializer=JSONSerializer).return_value()))
        if step == 1:
            ready = next(e for e in EventStream(conn).history(run=RUN) if e.kind is EventKind.ADAPTER_READY)
            loaded = Event(kind=EventKind.ADAPTER_LOADED, run=RUN, version=1, job_id="job-1",
                           data={"adapter": f"{RUN}-v1", "replica": "test", "load_ms": 1.0, "step": 1})
            EventStream(conn).append(loaded)
            served_after = loaded.ts - ready.data["stepped_at"]
    return results, served_after


# MLflow ---------------------------------------------------------------------------
@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """`mlflow server` on loopback with a sqlite backend in the test's directory; its URL."""
    port = free_port()
    home = tmp_path / "mlflow"
    home.mkdir()
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    argv = [mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}", "--default-artifact-root", str(home / "artifacts")]
    url = f"http://127.0.0.1:{port}"
    with served_process(argv, tmp_path / "mlflow.log", f"{url}/health", what="mlflow server", timeout_s=120, cwd=home):
        yield url


def test_the_run_curves_reach_a_real_mlflow_tracking_server(workers, redis_conn, tiny_model: Path,
                                                            mlflow_server: str) -> None:
    from mlflow import MlflowClient

    worker = workers({"TANDEM_TRACKER__KIND": "mlflow", "TANDEM_TRACKER__MLFLOW_URI": mlflow_server,
                      "TANDEM_TRACKER__EXPERIMENT": "curves"})
    results, served_after = train_steps(redis_conn, worker, tiny_model)
    assert worker.stop() == 0
    assert "tracker.failed" not in worker.log()

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("curves")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id], filter_string=f"tags.`tandem.run` = '{RUN}'")
    assert run.info.run_name == RUN
    assert run.data.params["lora.r"] == "4" and run.data.params["loss.kl_coef"] == "0.05"
    for key in CURVES:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == [1, 2, 3], key
        assert [m.value for m in history] == pytest.approx([r.metrics[key] for r in results]), key
    assert [m.value for m in client.get_metric_history(run.info.run_id, "rollout_version_max")] == [0, 1, 2]
    [served] = client.get_metric_history(run.info.run_id, "step_to_serving_s")
    assert served.step == 1 and served.value == pytest.approx(served_after, abs=1e-3) and served.value > 0

    # A trainer that starts again logs on into the same MLflow run.
    again = workers({"TANDEM_TRACKER__KIND": "mlflow", "TANDEM_TRACKER__MLFLOW_URI": mlflow_server,
                     "TANDEM_TRACKER__EXPERIMENT": "curves"})
    enqueue(redis_conn, make_job("job-4", step=4, version=3, seed=4))
    wait_for(lambda: status(redis_conn, "job-4") == JobStatus.FINISHED, 90, "job 4", again)
    assert again.stop() == 0
    [same] = client.search_runs([experiment.experiment_id], filter_string=f"tags.`tandem.run` = '{RUN}'")
    assert same.info.run_id == run.info.run_id
    assert [m.step for m in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)] == [
        1, 2, 3, 4]


def test_a_tracker_that_cannot_be_reached_costs_only_the_curve(workers, redis_conn, tiny_model: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    worker = workers({"TANDEM_TRACKER__KIND": "mlflow", "TANDEM_TRACKER__MLFLOW_URI": dead,
                      "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"})
    Registry(redis_conn).create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4)))
    enqueue(redis_conn, make_job("job-1"))
    wait_for(lambda: status(redis_conn, "job-1") == JobStatus.FINISHED, 120, "the job", worker)
    assert Registry(redis_conn).latest_version(RUN) == 1
    # the tracker's thread meets the failure after the job, which never waits on it
    wait_for(lambda: "tracker.failed run=worker-run version=1" in worker.log(), 60, "tracker.failed", worker)
    reply = httpx.get(worker.metrics_url, timeout=10).text
    assert "tandem_trainer_tracker_errors_total 1.0" in reply
    assert worker.stop() == 0


def test_a_tracking_server_that_hangs_holds_no_step(workers, redis_conn, tiny_model: Path) -> None:
    """A tracking server that takes connections and never answers (one that is SIGSTOPped, say), with
    MLflow's HTTP settings left to the trainer: the jobs go on at their own pace, and the failure is
    logged and counted within seconds."""
    with socket.create_server(("127.0.0.1", 0)) as hung:  # listens, never accepts: requests wait in its backlog
        worker = workers({"TANDEM_TRACKER__KIND": "mlflow",
                          "TANDEM_TRACKER__MLFLOW_URI": f"http://127.0.0.1:{hung.getsockname()[1]}"})
        Registry(redis_conn).create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4)))
        enqueue(redis_conn, make_job("job-1", step=1, seed=1))
        enqueue(redis_conn, make_job("job-2", step=2, seed=2))
        # MLflow's own defaults (120 s per request, 7 retries) held job 1 for minutes
        wait_for(lambda: status(redis_conn, "job-2") == JobStatus.FINISHED, 120, "both jobs", worker)
        assert Registry(redis_conn).latest_version(RUN) == 2
        wait_for(lambda: "tracker.failed run=worker-run version=1 kind=mlflow" in worker.log(), 60, "tracker.failed",
                 worker)
        assert "the curve skips this step" in worker.log()
        wait_for(lambda: tracker_errors(worker) >= 1, 30, "the failure to be counted", worker)
        assert worker.stop() == 0  # the queue drains within its bound


def tracker_errors(worker: WorkerProcess) -> float:
    """`tandem_trainer_tracker_errors_total` on the worker's /metrics."""
    reply = httpx.get(worker.metrics_url, timeout=10).text
    return float(next(line.split()[1] for line in reply.splitlines()
                      if line.startswith("tandem_trainer_tracker_errors_total ")))


# Weights & Biases (offline) ------------------------------------------------------------
def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of an offline run's `.wandb` file: W&B's LevelDB-style log of 32 KiB
    blocks, each record a 7-byte header (crc32c, length, type) and its data, after a 7-byte file
    header (`:W&B`, magic 0xBEE1, version 0)."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:header])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is no W&B run log"
    index, pending = header, b""
    while True:
        if block - index % block < header:
            index += block - index % block  # the block's tail is padding
        if index + header > len(data):
            return
        _crc, length, kind = struct.unpack("<IHB", data[index:index + header])
        if length == 0 and kind == 0:
            return
        index += header
        pending += data[index:index + length]
        index += length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_the_run_curves_are_in_the_offline_wandb_run(workers, redis_conn, tiny_model: Path, tmp_path: Path) -> None:
    worker = workers({"TANDEM_TRACKER__KIND": "wandb", "TANDEM_TRACKER__WANDB_DIR": str(tmp_path / "tracking"),
                      "TANDEM_TRACKER__EXPERIMENT": "curves", "WANDB_SILENT": "true"})
    results, served_after = train_steps(redis_conn, worker, tiny_model)
    assert worker.stop() == 0  # the warm shutdown finishes the W&B run
    assert "tracker.failed" not in worker.log()

    [run_dir] = (tmp_path / "tracking" / "wandb").glob(f"offline-run-*-{RUN}")
    rows: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    for record in wandb_records(run_dir / f"run-{RUN}.wandb"):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = rows.setdefault(record.history.step.num, {})
            row.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item})
        elif kind == "run":
            assert record.run.project == "curves" and record.run.display_name == RUN
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    assert sorted(rows) == [1, 2, 3]
    for key in CURVES:
        assert [rows[step][key] for step in (1, 2, 3)] == pytest.approx([r.metrics[key] for r in results]), key
    served = [row for row in rows.values() if "step_to_serving_s" in row]
    assert [(row["serving_version"], row["step_to_serving_s"]) for row in served] == [
        (1, pytest.approx(served_after, abs=1e-3))]
    assert config["lora.r"] == 4 and config["loss.kl_coef"] == 0.05
