"""A Redis outage at the end of a job, against a real worker and a real redis-server.

The test's own redis-server is stopped while the job trains and started again, on the same
port with the same append-only file, once the job has put its version in the store and is
waiting to register it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.jobs import RUN, make_job
from helpers.redis_server import RedisServer
from helpers.workers import start_workers, stop_workers, wait_for
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem.adapters import AdapterStore
from tandem.events import EventKind, EventStream
from tandem.jobs import TrainResult, enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, RunSpec

pytestmark = pytest.mark.integration


def test_a_redis_outage_at_the_end_of_a_job_is_ridden_out(tmp_path: Path, tiny_model: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    root = tmp_path / "adapters"
    root.mkdir()
    start, started = start_workers(server.url, root, tmp_path)
    try:
        conn = server.connect()
        # Six passes over 32 sequences of 300 tokens: a few seconds of work on the tiny model.
        Registry(conn).create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4),
                                          loss=LossConfig(epochs=6)))
        job_id = enqueue(conn, make_job("outage-job", groups=4, size=8, prompt=100, completion=200))
        worker = start({"TANDEM_REDIS_OUTAGE_S": "120"})
        wait_for(lambda: "adapter.activate" in worker.log(), 120, "training to begin", worker)
        conn.close()
        server.stop()

        store = AdapterStore(root)
        wait_for(lambda: store.versions(RUN) == [1], 120, "the version to reach the store", worker)
        time.sleep(3)  # the worker now waits for Redis to register it
        assert worker.proc.poll() is None
        server.start()

        conn = server.connect()
        wait_for(lambda: Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status()
                 == JobStatus.FINISHED, 120, "the job to finish", worker)
        result = TrainResult.model_validate(Job.fetch(job_id, connection=conn,
                                                      serializer=JSONSerializer).return_value())
        assert (result.version, result.parent, result.reused) == (1, 0, False)
        registry = Registry(conn)
        assert [m.version for m in registry.manifests(RUN)] == [1] and registry.version_of_job(RUN, job_id) == 1
        events = EventStream(conn).history()
        assert [(e.kind, e.version) for e in events if e.job_id == job_id] == [(EventKind.ADAPTER_READY, 1)]
        assert store.versions(RUN) == [1]
        assert "redis.unavailable" in worker.log()
        assert worker.stop() == 0  # alive all along: a warm shutdown on SIGTERM
    finally:
        stop_workers(started)
        server.stop()
