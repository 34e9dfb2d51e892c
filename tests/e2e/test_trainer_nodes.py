"""One trainer of two nodes, each its own container: compose.trainer-nodes.yaml on the CPU stack.

The containers `trainer` and `trainer-peer` meet at a c10d rendezvous on the compose network
(`trainer:29400`) and train every job as two ranks over gloo, as two machines would. The same
jobs, trained by one process here (the real worker, the same tiny model, a Redis of its own),
give the same adapters within the tolerance of the one-machine parity test
(tests/integration/test_data_parallel.py).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from compose_stack import MODEL, ComposeStack, started_stack, wait_for
from helpers.jobs import status, uneven_job
from helpers.workers import WorkerProcess
from helpers.workers import wait_for as wait_for_worker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from safetensors.torch import load_file

from tandem import Client
from tandem.adapters import AdapterStore
from tandem.jobs import TrainResult, enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, OptimizerConfig, RunSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 3
#: the one-machine parity test's micro-batch budget: every job packs into several micro-batches
BUDGET = {"TANDEM_BACKEND__MICRO_BATCH_TOKENS": "256"}


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    yield from started_stack(request, tmp_path_factory, files=("compose.trainer-nodes.yaml",),
                             env=f"TRAINER_MICRO_BATCH_TOKENS={BUDGET['TANDEM_BACKEND__MICRO_BATCH_TOKENS']}\n",
                             services=("redis", "engine", "inference", "trainer", "trainer-peer"))


def spec(name: str, model: str) -> RunSpec:
    return RunSpec(name=name, base_model=model, lora=LoraConfig(r=4, alpha=8.0),
                   optimizer=OptimizerConfig(lr=1e-2), loss=LossConfig(epochs=2), max_staleness_steps=4)


def test_two_trainer_containers_train_as_one_trainer_of_two_ranks(
    stack: ComposeStack, redis_url: str, tiny_model: Path, tmp_path: Path,
) -> None:
    client = Client(stack.gateway_url, stack.redis_url)
    try:
        Registry(client.conn).create_run(spec("nodes", MODEL))
        nodes = []
        for step in range(1, STEPS + 1):
            job = uneven_job("nodes", step)
            enqueue(client.conn, job)
            wait_for(lambda job=job: status(client.conn, job.job_id) == JobStatus.FINISHED, 240, f"job {job.job_id}")
            done = Job.fetch(job.job_id, connection=client.conn, serializer=JSONSerializer).return_value()
            nodes.append(TrainResult.model_validate(done))
    finally:
        client.close()
    logs = stack.logs_of("trainer") + stack.logs_of("trainer-peer")
    assert "--rdzv-backend=c10d --rdzv-endpoint=trainer:29400" in logs
    assert "parallel.start rank=0 world=2" in logs and "parallel.start rank=1 world=2" in logs
    assert "rank.follow rank=1 world=2" in logs
    # each container holds one of the two ranks
    for service in ("trainer", "trainer-peer"):
        assert stack.logs_of(service).count("parallel.start rank=") == 1, service

    # the same jobs, one process
    import redis

    conn = redis.Redis.from_url(redis_url)
    Registry(conn).create_run(spec("single", str(tiny_model)))
    root = tmp_path / "adapters"
    root.mkdir()
    single = WorkerProcess(redis_url, root, tmp_path / "single.log",
                           {**BUDGET, "TANDEM_WORKER_NAME": "single", "OMP_NUM_THREADS": "1"})
    one = []
    try:
        for step in range(1, STEPS + 1):
            job = uneven_job("single", step)
            enqueue(conn, job)
            wait_for_worker(lambda job=job: status(conn, job.job_id) == JobStatus.FINISHED, 240,
                            f"job {job.job_id}", single)
            one.append(TrainResult.model_validate(
                Job.fetch(job.job_id, connection=conn, serializer=JSONSerializer).return_value()))
    finally:
        assert single.stop() == 0

    for a, b in zip(one, nodes, strict=True):
        assert (a.version, a.parent) == (b.version, b.parent)
        assert (a.metrics["ranks"], b.metrics["ranks"]) == (1.0, 2.0)
        assert b.metrics["microbatches"] >= 2  # the job was split between the nodes
        for key in ("loss", "approx_kl", "ratio_mean", "entropy", "grad_norm", "tokens"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), key
        mine = load_file(str(AdapterStore(root).version_dir("single", a.version) / "adapter" / "adapter_model.safetensors"))
        theirs = container_adapter(stack, "nodes", b.version, tmp_path)
        assert mine.keys() == theirs.keys()
        for k in mine:  # the parity test's tolerance: float32 sums in another order, Adam's first steps
            torch.testing.assert_close(theirs[k], mine[k], rtol=1e-3, atol=1e-5, msg=k)


def container_adapter(stack: ComposeStack, run: str, version: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    """A version's adapter weights as the nodes wrote them to the shared volume."""
    inside = AdapterStore(Path("/adapters")).version_dir(run, version) / "adapter" / "adapter_model.safetensors"
    local = tmp_path / f"{run}-v{version}.safetensors"
    subprocess.run(["docker", "cp", f"{stack.container('trainer')}:{inside}", str(local)], check=True,
                   capture_output=True, timeout=60)
    return load_file(str(local))
