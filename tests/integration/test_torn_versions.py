"""The fsync moved off the path to serving: a version torn by a power loss never serves.

The trainer renames a version into place and announces it before its files are fsynced. A
power loss in between can leave the version visible with files whose bytes never reached the
disk. This drill makes exactly that: a trainer is killed right after the announcement
(failpoint `after_announce`), the inference side is down, and the adapter's weights are
overwritten with zeros past the safetensors header -- a file any engine would still open and
load. Then the inference side starts, as after a reboot, and a new trainer picks the work up.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
from helpers.jobs import make_job, status
from helpers.redis_server import RedisServer
from helpers.workers import start_workers, stop_workers, wait_for
from rq.job import JobStatus
from test_worker_kills import InferenceStack

from tandem.adapters import AdapterStore
from tandem.dev.composition import StackConfig
from tandem.events import EventKind, EventStream
from tandem.jobs import enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, RunSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "torn"


def tear(weights: Path) -> None:
    """What a lost page cache leaves: the right size and header, zeros where the tensors were."""
    raw = weights.read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    weights.write_bytes(raw[:data_start] + bytes(len(raw) - data_start))


def test_a_version_torn_before_its_fsync_is_refused_and_training_resumes_below_it(
        tmp_path: Path, tiny_model: Path) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    workdir = tmp_path / "stack"
    root = workdir / "adapters"
    root.mkdir(parents=True)
    start, started = start_workers(redis.url, root, tmp_path)
    conn = redis.connect()
    try:
        registry, events = Registry(conn), EventStream(conn)
        registry.create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4)))
        first = enqueue(conn, make_job("first", run=RUN, step=1, seed=1))
        worker = start()
        wait_for(lambda: status(conn, first) == JobStatus.FINISHED, 90, "v1 to be trained", worker)
        worker.stop()

        second = enqueue(conn, make_job("second", run=RUN, step=2, seed=2, version=1))
        armed = start({"TANDEM_TRAINER_FAILPOINTS": "after_announce"})
        assert armed.wait_dead() == -signal.SIGKILL
        assert registry.latest_version(RUN) == 2  # registered and announced, never fsynced ...
        weights = root / RUN / "v000002" / "adapter" / "adapter_model.safetensors"
        tear(weights)  # ... and the power went

        config = StackConfig(state_dir=workdir, model=str(tiny_model), gateway_port=0, redis_url=redis.url,
                             extra_env={"TANDEM_ENGINE__ADMIN_API_KEY": "torn-tests"})
        with InferenceStack(config) as stack:
            def refused() -> bool:
                return any(e.kind is EventKind.ADAPTER_REJECTED and e.version == 2
                           for e in events.history(run=RUN))
            wait_for(refused, 120, "the torn v2 to be refused", armed)
            rejected = [e for e in events.history(run=RUN) if e.kind is EventKind.ADAPTER_REJECTED]
            assert {e.version for e in rejected} == {2}  # by the reconcile at start and by its event
            assert all("checksum of adapter/adapter_model.safetensors" in e.data["message"] for e in rejected)
            wait_for(lambda: registry.serving(RUN) == 1, 60, "v1 to serve", armed)
            reply = httpx.post(f"{stack.gateway_url}/v1/completions",
                               json={"model": RUN, "prompt": "1", "max_tokens": 1}, timeout=60)
            assert reply.status_code == 200 and reply.headers["x-tandem-version"] == "1"

            rescuer = start()  # the killed job ends with the version it registered; nothing retrains it
            wait_for(lambda: status(conn, second) == JobStatus.FINISHED, 90, "the killed job to finish", rescuer)
            third = enqueue(conn, make_job("third", run=RUN, step=3, seed=3, version=1))
            wait_for(lambda: status(conn, third) == JobStatus.FINISHED, 90, "v3 to be trained", rescuer)
            assert "train.skip run=torn version=2" in rescuer.log()  # its checksums fail: not trained from
            v3 = registry.manifest(RUN, 3)
            assert v3 is not None and v3.parent == 1
            wait_for(lambda: registry.serving(RUN) == 3, 60, "v3 to serve", rescuer)
            assert AdapterStore(root).verify(RUN, 3).version == 3
            assert not any(e.kind is EventKind.ADAPTER_LOADED and e.version == 2 for e in events.history(run=RUN))
    finally:
        stop_workers(started)
        conn.close()
        redis.stop()
