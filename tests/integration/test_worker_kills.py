"""A trainer SIGKILLed at every failpoint of a job: the job still ends exactly once and serves.

For each point a trainer armed with that failpoint (`TANDEM_TRAINER_FAILPOINTS`) takes a
client's job and kills itself there; a second, unarmed trainer recovers the job. A real
inference side (the transformers engine, the controller and gateway) runs beside them, so the
client's `TrainHandle.result()` returns only once the version serves.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jobs import status
from helpers.redis_server import RedisServer
from helpers.workers import WorkerProcess, start_workers, stop_workers, wait_for
from rq.job import JobStatus

from tandem import Client, LoraConfig
from tandem.adapters import AdapterStore
from tandem.dev.composition import StackConfig
from tandem.dev.stack import Stack
from tandem.dev.supervisor import Service
from tandem.events import EventKind
from tandem.registry import Registry
from tandem.trajectories import TrajectoryGroup
from tandem_trainer.failpoints import POINTS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: The trainers' liveness TTL (`liveness_ttl_s`, 8 s unset): a killed trainer is known dead, and its
#: job handed back, this long after it died.
FAST_LIVENESS = {"TANDEM_LIVENESS_TTL_S": "4"}


class InferenceStack(Stack):
    """The local stack without its trainer: the tests start their own."""

    def plan(self) -> list[Service]:
        return [svc for svc in super().plan() if svc.name != "trainer"]


class Side:
    def __init__(self, redis: RedisServer, stack: Stack) -> None:
        self.redis, self.stack = redis, stack
        self.root = stack.state / "adapters"
        self.client = Client(stack.gateway_url, redis.url)


@pytest.fixture(scope="module")
def side(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Side]:
    workdir = tmp_path_factory.mktemp("kills")
    redis = RedisServer(workdir / "redis").start()
    config = StackConfig(state_dir=workdir / "stack", model=str(tiny_model), gateway_port=0, redis_url=redis.url,
                         extra_env={"TANDEM_ENGINE__ADMIN_API_KEY": "kill-tests",
                                    "TANDEM_ENGINE__MAX_LOADED_ADAPTERS": str(2 * len(POINTS))})
    try:  # a stack that fails to start must not leave its Redis behind
        with InferenceStack(config) as stack:
            (stack.state / "adapters").mkdir(parents=True, exist_ok=True)
            side = Side(redis, stack)
            yield side
            side.client.close()
    finally:
        redis.stop()


def taken_or_dead(worker: WorkerProcess, job_id: str) -> bool:
    """Whether `worker` took the job (rq logs its id as it dequeues it) or already died."""
    return job_id in worker.log() or worker.proc.poll() is not None


def groups(seed: int) -> list[TrajectoryGroup]:
    rng = random.Random(seed)
    out = []
    for _ in range(2):
        prompt = [rng.randrange(3, 500) for _ in range(6)]
        out.append(TrajectoryGroup.model_validate({"trajectories": [
            {"prompt_ids": prompt, "completion_ids": [rng.randrange(3, 500) for _ in range(8)],
             "rollout_logprobs": [-6.2] * 8, "reward": rng.random()} for _ in range(4)
        ]}))
    return out


@pytest.mark.parametrize("point", POINTS)
def test_a_trainer_killed_at_any_point_leaves_one_served_version(point: str, side: Side, tmp_path: Path,
                                                                 tiny_model: Path) -> None:
    run = side.client.create_run(f"kill-{point.replace('_', '-')}", base_model=str(tiny_model), lora=LoraConfig(r=4))
    start, started = start_workers(side.redis.url, side.root, tmp_path)
    try:
        armed = start({**FAST_LIVENESS, "TANDEM_TRAINER_FAILPOINTS": point})
        handle = run.train(groups(seed=len(point)), wait=False, timeout_s=300)
        # the rescuer starts once the job is the armed trainer's: it cannot take the job before
        # the armed one dies, and it loads while the armed one runs to its failpoint
        wait_for(lambda: taken_or_dead(armed, handle.job_id), 120, "the armed trainer to take the job", armed)
        rescuer = start(FAST_LIVENESS)
        assert armed.wait_dead() == -signal.SIGKILL
        assert f"failpoint {point}" in armed.log()

        result = handle.result(timeout_s=120)  # returns once the version serves
        assert (result.version, result.parent, result.job_id) == (1, 0, handle.job_id)

        conn = side.client.conn
        wait_for(lambda: status(conn, handle.job_id) == JobStatus.FINISHED, 60, "rq to finish the job", rescuer)
        registry = Registry(conn)
        assert [m.version for m in registry.manifests(run.name)] == [1]
        assert AdapterStore(side.root).versions(run.name) == [1]
        history = run.history()
        assert [(e.version, e.job_id) for e in history if e.kind == EventKind.ADAPTER_READY] == [(1, handle.job_id)]
        assert not [e for e in history if e.kind == EventKind.TRAIN_FAILED]
        assert registry.serving(run.name) == 1
    finally:
        stop_workers(started)


def test_a_job_requeued_after_its_trainer_died_publishes_before_the_steps_sent_after_it(
    side: Side, tmp_path: Path, tiny_model: Path
) -> None:
    """Three pipelined steps; the trainer dies inside the first and comes back under its name (as
    compose and `tandem up` restart it). rq requeues the job, and it must not go behind the other
    two: the steps publish as versions 1, 2, 3 in the order they were sent."""
    run = side.client.create_run("kill-pipelined", base_model=str(tiny_model), lora=LoraConfig(r=4),
                                 max_staleness_steps=3)
    start, started = start_workers(side.redis.url, side.root, tmp_path)
    try:
        named = {**FAST_LIVENESS, "TANDEM_WORKER_NAME": "trainer-pipelined"}
        armed = start({**named, "TANDEM_TRAINER_FAILPOINTS": "mid_training"})
        handles = [run.train(groups(seed=s), wait=False, timeout_s=300) for s in (1, 2, 3)]
        assert armed.wait_dead() == -signal.SIGKILL
        start(named)
        results = [h.result(timeout_s=120) for h in handles]
        assert [(r.job_id, r.version, r.parent) for r in results] == [
            (h.job_id, v, v - 1) for h, v in zip(handles, (1, 2, 3), strict=True)
        ]
        assert not [e for e in run.history() if e.kind == EventKind.TRAIN_FAILED]
    finally:
        stop_workers(started)
