"""The trainer's /metrics, scraped from the real worker process after real jobs on the tiny model."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from helpers.jobs import RUN, make_job, status
from helpers.workers import WorkerProcess, wait_for
from prometheus_client.parser import text_string_to_metric_families
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem.jobs import TrainResult, enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, RunSpec

pytestmark = pytest.mark.integration


def scrape(worker: WorkerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the worker's /metrics: (name, sorted labels) → value."""
    reply = httpx.get(worker.metrics_url, timeout=10)
    reply.raise_for_status()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text) for sample in family.samples
    }


def test_a_worker_exports_its_steps_outcomes_and_queue(workers, redis_conn, tiny_model: Path) -> None:
    Registry(redis_conn).create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4),
                                            loss=LossConfig(kl_coef=0.05)))
    bad = make_job("bad-job")
    bad.groups[0].trajectories[0].completion_ids[2] = 4096  # outside the tiny vocabulary: rejected, not retried
    t0 = time.time()
    worker = workers()
    worker.wait_listening()
    before = scrape(worker)
    assert before[("tandem_trainer_jobs_total", (("outcome", "finished"),))] == 0
    assert before[("tandem_trainer_queue_depth", ())] == 0
    assert before[("tandem_trainer_job_in_progress", ())] == 0
    enqueue(redis_conn, bad)
    enqueue(redis_conn, make_job("good-job", seed=1))
    wait_for(lambda: status(redis_conn, "good-job") == JobStatus.FINISHED, 90, "the good job", worker)
    result = TrainResult.model_validate(Job.fetch("good-job", connection=redis_conn,
                                                  serializer=JSONSerializer).return_value())
    run = (("run", RUN),)

    after = scrape(worker)
    assert after[("tandem_trainer_jobs_total", (("outcome", "finished"),))] == 1
    assert after[("tandem_trainer_jobs_total", (("outcome", "failed"),))] == 1
    assert after[("tandem_trainer_jobs_total", (("outcome", "retried"),))] == 0
    assert after[("tandem_trainer_queue_depth", ())] == 0
    assert after[("tandem_trainer_job_in_progress", ())] == 0
    for name, key in (("tandem_trainer_loss", "loss"), ("tandem_trainer_entropy", "entropy"),
                      ("tandem_trainer_clip_fraction", "clip_frac"), ("tandem_trainer_grad_norm", "grad_norm"),
                      ("tandem_trainer_reward_mean", "reward_mean"), ("tandem_trainer_microbatches", "microbatches")):
        assert after[(name, run)] == pytest.approx(result.metrics[key]), name
    assert after[("tandem_trainer_kl", (("against", "rollout"), *run))] == pytest.approx(result.metrics["approx_kl"])
    assert after[("tandem_trainer_kl", (("against", "reference"), *run))] == pytest.approx(result.metrics["ref_kl"])
    assert after[("tandem_trainer_tokens_total", run)] == result.metrics["tokens"] > 0
    assert after[("tandem_trainer_tokens_per_second", run)] == pytest.approx(
        result.metrics["tokens"] / result.metrics["train_s"])
    assert after[("tandem_trainer_published_version", run)] == result.version == 1
    assert after[("tandem_trainer_rollout_staleness_steps", run)] == 0
    assert t0 < after[("tandem_trainer_last_step_timestamp_seconds", ())] < time.time()
    for stage in ("train", "publish", "state"):
        assert after[("tandem_trainer_stage_seconds_count", (("stage", stage),))] == 1, stage
    assert after[("tandem_trainer_job_seconds_count", ())] == 2  # the refused job and the good one
    assert not any(name == "tandem_trainer_gpu_memory_bytes" for name, _ in after)  # no CUDA here
    # the job's switch to its run: version 0, a fresh adapter (backends/resident.py)
    assert after[("tandem_trainer_resident_switches_total", (("outcome", "fresh"),))] == 1
    assert after[("tandem_trainer_resident_switches_total", (("outcome", "hit"),))] == 0
    assert after[("tandem_trainer_resident_runs", (("place", "host"),))] == 0

    # While a long job trains, the jobs behind it are the queue's depth.
    assert worker.stop() == 0
    enqueue(redis_conn, make_job("long", step=2, version=1, groups=4, size=8, prompt=100, completion=200))
    enqueue(redis_conn, make_job("waits-1", step=3, version=1, seed=2))
    enqueue(redis_conn, make_job("waits-2", step=4, version=2, seed=3))
    second = workers()
    wait_for(lambda: "adapter.activate" in second.log(), 90, "the long job to train", second)
    busy = scrape(second)
    assert busy[("tandem_trainer_queue_depth", ())] == 2
    assert busy[("tandem_trainer_job_in_progress", ())] == 1
    wait_for(lambda: status(redis_conn, "waits-2") == JobStatus.FINISHED, 120, "the queued jobs", second)
    done = scrape(second)
    assert done[("tandem_trainer_jobs_total", (("outcome", "finished"),))] == 3
    assert done[("tandem_trainer_queue_depth", ())] == 0
    assert done[("tandem_trainer_published_version", run)] == 4
    assert done[("tandem_trainer_rollout_staleness_steps", run)] == 1  # v2's rollouts, trained from v3


def test_a_port_that_is_taken_stops_the_worker_with_the_setting_to_change(workers, redis_conn, tiny_model: Path,
                                                                        tmp_path: Path) -> None:
    first = workers()
    first.wait_listening()
    port = first.metrics_url.split(":")[-1].split("/")[0]
    second = workers({"TANDEM_METRICS__PORT": port, "TANDEM_WORKER_NAME": "second"})
    assert second.proc.wait(60) == 1
    assert f"cannot serve the trainer's /metrics on 127.0.0.1:{port}" in second.log()
    assert "TANDEM_METRICS__PORT" in second.log()
