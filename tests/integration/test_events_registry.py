from __future__ import annotations

import pytest

from tandem.adapters import Manifest
from tandem.errors import RunExists, RunNotFound
from tandem.events import Cursor, Event, EventKind, EventStream
from tandem.registry import Registry
from tandem.runs import LoraConfig, RunSpec

pytestmark = pytest.mark.integration


def manifest(version: int, job: str = "j") -> Manifest:
    return Manifest(run="r", version=version, parent=version - 1, step=version, job_id=job, base_model="m", lora_rank=8)


def test_events_survive_a_consumer_that_was_away(redis_conn) -> None:
    stream = EventStream(redis_conn)
    cursor = Cursor(redis_conn, "inference")
    first = stream.append(Event(kind=EventKind.ADAPTER_READY, run="r", version=1, data={"path": "r/v000001/adapter"}))
    got = stream.read(cursor.get())
    assert [e.version for e in got] == [1] and got[0].data == {"path": "r/v000001/adapter"}
    cursor.commit(got[-1].id)
    assert got[-1].id == first
    # the consumer is down while two more events arrive
    stream.append(Event(kind=EventKind.ADAPTER_READY, run="r", version=2))
    stream.append(Event(kind=EventKind.TRAIN_FAILED, run="r", job_id="j3", data={"message": "bad"}))
    again = Cursor(redis_conn, "inference")
    caught_up = stream.read(again.get())
    assert [(e.kind, e.version) for e in caught_up] == [(EventKind.ADAPTER_READY, 2), (EventKind.TRAIN_FAILED, None)]
    assert caught_up[1].job_id == "j3"


def test_read_blocks_until_timeout_when_nothing_new(redis_conn) -> None:
    stream = EventStream(redis_conn)
    assert stream.read(stream.last_id(), block_ms=50) == []


def test_history_filters_by_run(redis_conn) -> None:
    stream = EventStream(redis_conn)
    for run in ["a", "b", "a"]:
        stream.append(Event(kind=EventKind.ADAPTER_LOADED, run=run, version=1))
    assert [e.run for e in stream.history(run="a")] == ["a", "a"]


def test_runs_are_created_once(redis_conn) -> None:
    reg = Registry(redis_conn)
    spec = RunSpec(name="r", base_model="m")
    assert reg.create_run(spec) == spec
    assert reg.create_run(spec) == spec
    with pytest.raises(RunExists, match="another spec"):
        reg.create_run(RunSpec(name="r", base_model="m", lora=LoraConfig(r=4)))
    with pytest.raises(RunNotFound, match=r"known runs: \['r'\]"):
        reg.get_run("nope")


def test_versions_and_jobs_are_registered_idempotently(redis_conn) -> None:
    reg = Registry(redis_conn)
    assert reg.latest_version("r") == 0
    reg.register_version(manifest(1, "j1"))
    reg.register_version(manifest(1, "j1"))
    reg.register_version(manifest(2, "j2"))
    assert reg.latest_version("r") == 2
    assert [m.version for m in reg.manifests("r")] == [1, 2]
    assert reg.version_of_job("r", "j1") == 1 and reg.version_of_job("r", "zz") is None
    assert reg.manifest("r", 2).job_id == "j2"
    reg.set_serving("r", 2)
    assert reg.serving("r") == 2
    assert reg.next_step("r") == 1 and reg.next_step("r") == 2
