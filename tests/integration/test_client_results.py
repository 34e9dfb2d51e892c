"""What `Run.train` returns, against a real redis-server and a real rq queue.

The trainer announces a version before it writes the optimizer state, so the version can serve
while its rq job is still running: the result then comes from the job's `adapter_ready` event.
"""

from __future__ import annotations

import pytest
import redis

from tandem import Client
from tandem.events import Event, EventKind, EventStream
from tandem.trajectories import Trajectory, TrajectoryGroup

pytestmark = pytest.mark.integration


def group() -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[
        Trajectory(prompt_ids=[1, 2], completion_ids=[3], rollout_logprobs=[-0.5], reward=r) for r in (0.0, 1.0)
    ])


def test_a_version_that_serves_before_its_job_ends_returns_a_whole_result(redis_conn: redis.Redis) -> None:
    client = Client("http://127.0.0.1:9", conn=redis_conn)
    run = client.create_run("early", base_model="tiny")
    handle = run.train([group()], wait=False)  # queued; no worker: rq has no return value for it
    events = EventStream(redis_conn)
    events.append(Event(
        kind=EventKind.ADAPTER_READY, run="early", version=1, job_id=handle.job_id,
        data={"path": "early/v000001/adapter", "step": 1, "parent": 0, "metrics": {"loss": 0.25, "train_s": 0.4},
              "published_at": 1700000000.5, "stepped_at": 1700000000.25},
    ))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="early", version=1, job_id=handle.job_id,
                        data={"adapter": "early-v1", "load_ms": 3.0}))

    result = handle.result(timeout_s=10)
    assert (result.job_id, result.run, result.version, result.step, result.parent) == (handle.job_id, "early", 1, 1, 0)
    assert result.published_at == 1700000000.5 and result.train_s == 0.4
    assert result.metrics["loss"] == 0.25 and result.metrics["served_at"] > 0


def test_an_adapter_ready_with_unexpected_data_still_gives_the_version(redis_conn: redis.Redis) -> None:
    client = Client("http://127.0.0.1:9", conn=redis_conn)
    run = client.create_run("odd", base_model="tiny")
    handle = run.train([group()], wait=False)
    events = EventStream(redis_conn)
    events.append(Event(kind=EventKind.ADAPTER_READY, run="odd", version=1, job_id=handle.job_id,
                        data={"step": 1, "parent": 0, "metrics": "not a mapping"}))
    events.append(Event(kind=EventKind.ADAPTER_LOADED, run="odd", version=1, job_id=handle.job_id, data={}))

    result = handle.result(timeout_s=10)
    assert (result.version, result.step, result.parent) == (1, 1, 0) and result.published_at > 0
