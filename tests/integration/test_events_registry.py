from __future__ import annotations

import time

import pytest

from tandem.adapters import Manifest
from tandem.errors import RunExists, RunNotFound
from tandem.events import Cursor, Event, EventKind, EventStream, entry_order
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


#: Entries anyone with Redis write access can append; each must be skipped, never fatal.
MALFORMED = {
    "version not a number": {"kind": "adapter_ready", "run": "R", "version": "abc", "ts": "1", "data": "{}"},
    "negative version": {"kind": "adapter_ready", "run": "R", "version": "-3", "ts": "1"},
    "unknown kind": {"kind": "adapter_exploded", "run": "R", "ts": "1"},
    "missing kind": {"run": "R", "ts": "1"},
    "missing run": {"kind": "adapter_ready", "version": "1", "ts": "1"},
    "missing ts": {"kind": "adapter_ready", "run": "R", "version": "1"},
    "ts not a number": {"kind": "adapter_ready", "run": "R", "version": "1", "ts": "yesterday"},
    "ts not finite": {"kind": "adapter_ready", "run": "R", "version": "1", "ts": "nan"},
    "data not JSON": {"kind": "adapter_ready", "run": "R", "version": "1", "ts": "1", "data": "{not json"},
    "data a list": {"kind": "adapter_ready", "run": "R", "version": "1", "ts": "1", "data": "[1, 2]"},
    "data a string": {"kind": "adapter_ready", "run": "R", "version": "1", "ts": "1", "data": '"x"'},
    "run not UTF-8": {"kind": "adapter_ready", "run": b"\xff\xfe", "version": "1", "ts": "1"},
    "key not UTF-8": {b"\xc3\x28": "x", "kind": "adapter_ready", "run": "R", "ts": "1"},
    "no fields but junk": {"junk": "1"},
}


@pytest.mark.parametrize("fields", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_entry_is_skipped_and_read_moves_past_it(redis_conn, fields) -> None:
    stream = EventStream(redis_conn)
    before = stream.append(Event(kind=EventKind.ADAPTER_LOADED, run="r", version=1))
    bad = redis_conn.xadd("tandem:events", fields).decode()
    page = stream.read("0-0")
    assert [e.id for e in page] == [before]
    assert page.last_id == bad and [m.entry_id for m in page.malformed] == [bad]
    # nothing more after it: the next read from the page's last id sees nothing, and new events still arrive
    assert stream.read(page.last_id, block_ms=10) == []
    after = stream.append(Event(kind=EventKind.ADAPTER_LOADED, run="r", version=2))
    assert [e.id for e in stream.read(page.last_id)] == [after]
    assert [e.version for e in stream.history()] == [1, 2]
    assert [e.version for e in stream.follow("0-0", deadline=time.monotonic() + 0.3)] == [1, 2]


@pytest.mark.parametrize("raw", ["{not json", '{"name": "bad"}', '{"name": "bad", "base_model": "m", "extra": 1}'])
def test_a_stored_run_spec_that_does_not_parse_is_validation_failed(redis_conn, raw) -> None:
    from tandem.errors import ValidationFailed

    redis_conn.set("tandem:run:bad", raw)
    with pytest.raises(ValidationFailed, match="tandem:run:bad"):
        Registry(redis_conn).get_run("bad")


def test_the_controller_status_and_load_attempts_go_through_the_registry(redis_conn) -> None:
    reg = Registry(redis_conn)
    assert [reg.next_load_attempt("r", 3) for _ in range(3)] == [0, 1, 2]
    assert reg.next_load_attempt("r", 4) == 0 and reg.next_load_attempt("other", 3) == 0
    reg.set_loaded("r", [2, 3])
    assert reg.loaded("r") == [2, 3] and reg.loaded("never") == []


def test_events_since_a_time_pages_forward_and_skips_what_does_not_parse(redis_conn) -> None:
    stream = EventStream(redis_conn)
    redis_conn.xadd("tandem:events", {"kind": "adapter_ready", "run": "old", "ts": "1"}, id="1000-0")
    redis_conn.xadd("tandem:events", {"junk": "1"}, id="2000-0")
    for version in range(1, 6):
        stream.append(Event(kind=EventKind.ADAPTER_READY, run="r", version=version))
    assert [e.run for e in stream.since(0.0, page=2)] == ["old", "r", "r", "r", "r", "r"]
    assert [e.version for e in stream.since(1.5, page=2)] == [1, 2, 3, 4, 5]
    assert list(stream.since(time.time() + 3600)) == []


def test_unread_returns_what_the_stream_holds_past_an_entry_without_waiting(redis_conn) -> None:
    stream = EventStream(redis_conn)
    first = stream.append(Event(kind=EventKind.ADAPTER_LOADED, run="r", version=1))
    redis_conn.xadd("tandem:events", {"junk": "1"})
    ids = [stream.append(Event(kind=EventKind.ADAPTER_READY, run="r", version=v)) for v in range(2, 7)]
    assert [e.version for e in stream.unread(first, page=2)] == [2, 3, 4, 5, 6]  # the junk skipped
    assert [e.version for e in stream.unread(ids[1], page=2)] == [4, 5, 6]
    assert [e.version for e in stream.unread(first, limit=3, page=2)] == [2, 3]  # 3 entries read, one junk
    assert stream.unread(ids[2]).last_id == ids[-1]  # where the next look reads on from
    assert stream.unread(ids[-1]) == [] and stream.unread(ids[-1]).last_id == ids[-1]  # nothing new: no wait
    assert stream.unread("0-0", limit=0) == []
    assert entry_order("1700000000000-12") > entry_order("1700000000000-9") > entry_order("999999999999-99")


STORED_GARBAGE = {
    "serving not a number": ("tandem:run:r:serving", "set", "three", lambda reg: reg.serving("r")),
    "job version not a number": ("tandem:run:r:jobs", "hset", "three", lambda reg: reg.version_of_job("r", "j")),
    "manifest not JSON": ("tandem:run:r:versions", "zadd", "{not json", lambda reg: reg.manifest("r", 1)),
    "manifests with one not a manifest": ("tandem:run:r:versions", "zadd", '{"run": "r"}', lambda reg: reg.manifests("r")),
    "loaded not a list of versions": ("tandem:run:r:loaded", "set", '{"a": 1}', lambda reg: reg.loaded("r")),
}


@pytest.mark.parametrize(("key", "how", "raw", "call"), STORED_GARBAGE.values(), ids=STORED_GARBAGE.keys())
def test_a_stored_value_that_does_not_parse_is_validation_failed_naming_its_key(redis_conn, key, how, raw,
                                                                                call) -> None:
    from tandem.errors import ValidationFailed

    if how == "set":
        redis_conn.set(key, raw)
    elif how == "hset":
        redis_conn.hset(key, "j", raw)
    else:
        redis_conn.zadd(key, {raw: 1})
    with pytest.raises(ValidationFailed, match=key):
        call(Registry(redis_conn))
