"""Shared mode on the local stack: the trainer borrows the engine's device for each job.

On CPU the engine has no GPU memory to free, but the hand-over is the same as on a GPU:
the trainer asks through the lease, inference drains, releases and grants, the trainer
trains, gives the lease back, inference resumes. Rollouts sent meanwhile wait; none fails.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC
from pathlib import Path

import httpx
import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from tandem import Client, LoraConfig
from tandem.dev.composition import StackConfig
from tandem.dev.stack import Stack
from tandem.events import EventKind

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_jobs_take_the_device_from_inference_and_give_it_back(tiny_model: Path, tmp_path: Path) -> None:
    config = StackConfig(state_dir=tmp_path / "stack", model=str(tiny_model), gateway_port=0,
                         extra_env={"TANDEM_GPUS__MODE": "shared"})
    with Stack(config) as stack:
        client = Client(stack.gateway_url, stack.redis_url)
        run = client.create_run("shared", base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8))
        statuses: list[int] = []
        stop = threading.Event()

        def roll_out() -> None:
            with httpx.Client(base_url=stack.gateway_url, timeout=60) as http:
                while not stop.is_set():
                    r = http.post("/v1/completions", json={"model": "shared", "prompt": "1", "max_tokens": 4})
                    statuses.append(r.status_code)

        rollers = [threading.Thread(target=roll_out) for _ in range(2)]
        for t in rollers:
            t.start()
        try:
            for step in range(3):
                comps = run.chat([{"role": "user", "content": "Count."}], n=4, max_tokens=6)
                result = run.train([run.group(comps, [0.0, 1.0, 0.5, 0.25])])
                assert result.version == step + 1
                assert result.metrics["gpu_wait_s"] >= 0
        finally:
            stop.set()
            for t in rollers:
                t.join(60)
        assert statuses and set(statuses) == {200}
        # the wait is in each version's adapter_ready too, so a result taken from the event (the
        # job's own rq result comes only after its optimizer state) carries it as well
        ready = [e for e in run.history() if e.kind is EventKind.ADAPTER_READY]
        assert [e.version for e in ready] == [1, 2, 3]
        assert all(e.data["metrics"]["gpu_wait_s"] >= 0 for e in ready), [e.data for e in ready]
        info = httpx.get(f"{stack.engine_url}/server_info").json()
        assert info["memory_released"] is False  # resumed after the last job
        client.close()
    inference_log = (stack.logs / "inference.log").read_text()
    trainer_log = (stack.logs / "trainer.log").read_text()
    assert inference_log.count("gpu lent to the trainer") == 3
    assert inference_log.count("gpu back") == 3
    assert trainer_log.count("gpu.lease.granted") == 3


def test_with_nothing_to_release_the_engine_keeps_its_memory_and_still_hands_over(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`TANDEM_GPUS__RELEASE_TAGS=[]`: the drain and the lease as before, no release or resume."""
    config = StackConfig(state_dir=tmp_path / "stack", model=str(tiny_model), gateway_port=0,
                         extra_env={"TANDEM_GPUS__MODE": "shared", "TANDEM_GPUS__RELEASE_TAGS": "[]"})
    with Stack(config) as stack:
        client = Client(stack.gateway_url, stack.redis_url)
        run = client.create_run("kept", base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8))
        for step in range(2):
            comps = run.chat([{"role": "user", "content": "Count."}], n=4, max_tokens=6)
            assert run.train([run.group(comps, [0.0, 1.0, 0.5, 0.25])]).version == step + 1
            assert run.chat([{"role": "user", "content": "Count."}], max_tokens=2)[0].version == step + 1
        client.close()
    inference_log = (stack.logs / "inference.log").read_text()
    engine_log = (stack.logs / "engine.log").read_text()
    assert inference_log.count("gpu lent to the trainer") == 2 and inference_log.count("gpu back") == 2
    assert "release_memory_occupation" not in engine_log and "memory_released device" not in engine_log


def test_serving_while_training_hands_nothing_over_and_answers_during_jobs(tiny_model: Path, tmp_path: Path) -> None:
    """`TANDEM_GPUS__SERVE_WHILE_TRAINING=true` (with nothing to release): no lease, no drain; the
    gateway answers while a job runs (a response lands between the job's rq start and end)."""
    config = StackConfig(state_dir=tmp_path / "stack", model=str(tiny_model), gateway_port=0,
                         extra_env={"TANDEM_GPUS__MODE": "shared", "TANDEM_GPUS__RELEASE_TAGS": "[]",
                                    "TANDEM_GPUS__SERVE_WHILE_TRAINING": "true"})
    with Stack(config) as stack:
        client = Client(stack.gateway_url, stack.redis_url)
        run = client.create_run("beside", base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8))
        answered: list[tuple[int, float]] = []
        stop = threading.Event()

        def roll_out() -> None:
            with httpx.Client(base_url=stack.gateway_url, timeout=60) as http:
                while not stop.is_set():
                    r = http.post("/v1/completions", json={"model": "beside", "prompt": "1", "max_tokens": 4})
                    answered.append((r.status_code, time.time()))

        rollers = [threading.Thread(target=roll_out) for _ in range(2)]
        for t in rollers:
            t.start()
        spans = []
        try:
            for step in range(3):
                comps = run.chat([{"role": "user", "content": "Count."}], n=4, max_tokens=6)
                result = run.train([run.group(comps, [0.0, 1.0, 0.5, 0.25])])
                assert result.version == step + 1
                assert "gpu_wait_s" not in result.metrics  # no lease was taken
                job = Job.fetch(result.job_id, connection=client.conn, serializer=JSONSerializer)
                assert job.started_at is not None and job.ended_at is not None
                spans.append((job.started_at.replace(tzinfo=UTC).timestamp(), job.ended_at.replace(tzinfo=UTC).timestamp()))
        finally:
            stop.set()
            for t in rollers:
                t.join(60)
        assert answered and {status for status, _ in answered} == {200}
        during = [at for _, at in answered if any(start < at < end for start, end in spans)]
        assert during, f"no response landed while one of the jobs {spans} ran"
        assert run.chat([{"role": "user", "content": "Count."}], max_tokens=2)[0].version == 3
        client.close()
    inference_log = (stack.logs / "inference.log").read_text()
    trainer_log = (stack.logs / "trainer.log").read_text()
    assert "gpu lent to the trainer" not in inference_log and "gpu.lease.granted" not in trainer_log
