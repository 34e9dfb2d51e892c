"""Jobs that someone with write access to Redis puts on the train queue, against a real worker.

rq imports and calls whatever function (and callback) a job names; the trainer runs only
tandem's train function. Every job it refuses or cannot read fails at once, without retries,
with a `train_failed` event naming the job and whatever run it names, and the worker serves
the next job.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers.jobs import make_job
from helpers.redis_server import RedisServer
from helpers.workers import WorkerProcess, start_workers, stop_workers, wait_for
from rq import Callback, Queue
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat
from rq.webhook import Webhook

from tandem import keys
from tandem.events import EventKind, EventStream
from tandem.jobs import TRAIN_FUNC, enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, RunSpec

pytestmark = pytest.mark.integration

HOOK_MODULE = "tandem_test_hook"
"""A module in the worker's working directory (first on its sys.path): importing it, or
calling its `hook`, leaves a file behind, so a test sees whether rq resolved a name it chose."""


class Hostile:
    """One worker on a Redis of its own, for the whole module."""

    def __init__(self, server: RedisServer, worker: WorkerProcess, workdir: Path, model: Path) -> None:
        self.server, self.worker, self.workdir, self.model = server, worker, workdir, model
        self.conn = server.connect()
        self.registry = Registry(self.conn)

    def create_run(self, name: str) -> str:
        self.registry.create_run(RunSpec(name=name, base_model=str(self.model), lora=LoraConfig(r=4)))
        return name

    def queue(self, serializer: Any = JSONSerializer) -> Queue:
        """A plain rq queue on the train queue's name, as any rq client would open it."""
        return Queue(keys.TRAIN_QUEUE, connection=self.conn, serializer=serializer)

    def status(self, job_id: str) -> str | None:
        raw = self.conn.hget(f"rq:job:{job_id}", "status")
        return raw.decode() if raw is not None else None

    def wait_ended(self, job_id: str, timeout_s: float = 120) -> str:
        wait_for(lambda: self.status(job_id) in ("finished", "failed"), timeout_s, f"job {job_id} to end",
                 self.worker)
        return str(self.status(job_id))

    def failed_events(self, job_id: str) -> list:
        return [e for e in EventStream(self.conn).history() if e.kind is EventKind.TRAIN_FAILED
                and e.job_id == job_id]

    def assert_serves_next(self, name: str) -> None:
        """The worker is alive and trains the next good job."""
        run = self.create_run(f"next-{name}")
        job_id = enqueue(self.conn, make_job(f"next-{name}", run=run))
        assert self.wait_ended(job_id) == "finished"
        assert self.registry.latest_version(run) == 1
        assert self.worker.proc.poll() is None


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Hostile]:
    workdir = tmp_path_factory.mktemp("hostile")
    (workdir / f"{HOOK_MODULE}.py").write_text(
        "import pathlib\n"
        "pathlib.Path('imported').touch()\n"
        "def hook(*args, **kwargs):\n"
        "    pathlib.Path('called').touch()\n"
    )
    (workdir / "adapters").mkdir()
    server = RedisServer(workdir / "redis").start()
    start, started = start_workers(server.url, workdir / "adapters", workdir)
    try:  # a worker that fails to start must not leave it or Redis behind
        worker = start()
        worker.wait_listening()
        yield Hostile(server, worker, workdir, tiny_model)
    finally:
        stop_workers(started)
        server.stop()


def raw_job(conn: redis.Redis, job_id: str, fields: dict[str, Any]) -> str:
    """Write a job hash by hand and push its id on the train queue, as a raw Redis client can."""
    base = {"status": "queued", "origin": keys.TRAIN_QUEUE, "created_at": utcformat(now()), "timeout": "300"}
    conn.hset(f"rq:job:{job_id}", mapping={**base, **fields})
    conn.rpush(f"rq:queue:{keys.TRAIN_QUEUE}", job_id)
    return job_id


def json_data(func: str, args: list[Any], kwargs: dict[str, Any] | None = None) -> bytes:
    return zlib.compress(json.dumps([func, None, args, kwargs or {}]).encode())


# Finding: a job naming another function, or any callback, ran that code in the trainer ------------
def _os_system(h: Hostile, name: str, marker: Path) -> tuple[str, str]:
    job = h.queue().enqueue("os.system", f"touch {marker}")
    return job.id, ""


def _os_system_raw(h: Hostile, name: str, marker: Path) -> tuple[str, str]:
    return raw_job(h.conn, f"raw-{name}", {"data": json_data("os.system", [f"touch {marker}"])}), ""


def _method_of_an_instance(h: Hostile, name: str, marker: Path) -> tuple[str, str]:
    data = zlib.compress(json.dumps(["__class__", "some instance", [], {}]).encode())
    return raw_job(h.conn, f"raw-{name}", {"data": data}), ""


def _callback(which: str) -> Callable[[Hostile, str, Path], tuple[str, str]]:
    def enqueue_with(h: Hostile, name: str, marker: Path) -> tuple[str, str]:
        run = h.create_run(f"run-{name}")
        payload = make_job(f"job-{name}", run=run).model_dump(mode="json")
        if which == "on_failure":
            payload["groups"] = []  # fails validation, which would call the failure callback
        job = h.queue().enqueue(TRAIN_FUNC, payload, job_id=f"job-{name}",
                                **{which: Callback(f"{HOOK_MODULE}.hook")})
        return job.id, run
    return enqueue_with


def _webhook(h: Hostile, name: str, marker: Path) -> tuple[str, str]:
    run = h.create_run(f"run-{name}")
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits.append(self.path)
            marker.touch()
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    job = h.queue().enqueue(TRAIN_FUNC, make_job(f"job-{name}", run=run).model_dump(mode="json"),
                            job_id=f"job-{name}", webhooks=[Webhook(url, "finished"), Webhook(url, "failed")])
    return job.id, run


FOREIGN = {
    "os_system": _os_system,
    "os_system_raw_hash": _os_system_raw,
    "method_of_an_instance": _method_of_an_instance,
    "on_success_callback": _callback("on_success"),
    "on_failure_callback": _callback("on_failure"),
    "on_stopped_callback": _callback("on_stopped"),
    "webhook": _webhook,
}


@pytest.mark.parametrize("case", list(FOREIGN))
def test_a_job_naming_other_code_is_refused_and_nothing_runs(case: str, hostile: Hostile) -> None:
    marker = hostile.workdir / f"marker-{case}"
    for leftover in ("imported", "called"):
        (hostile.workdir / leftover).unlink(missing_ok=True)
    job_id, run = FOREIGN[case](hostile, case.replace("_", "-"), marker)

    assert hostile.wait_ended(job_id) == "failed"
    time.sleep(0.5)  # a webhook or callback would have run by now
    assert not marker.exists()
    assert not (hostile.workdir / "imported").exists() and not (hostile.workdir / "called").exists()
    assert hostile.conn.hget(f"rq:job:{job_id}", "retries_left") in (None, b"0")  # not retried
    if run:
        assert hostile.registry.latest_version(run) == 0  # nothing trained
    [event] = hostile.failed_events(job_id)
    assert event.run == run and event.data["retries_left"] == 0
    assert "not allowed" in event.data["message"] and TRAIN_FUNC in event.data["message"]
    hostile.assert_serves_next(case.replace("_", "-"))


# Finding: some bad jobs left no `train_failed` event, or one without the job id ------------------
def _no_arguments(h: Hostile, name: str) -> tuple[str, str]:
    return h.queue().enqueue(TRAIN_FUNC, job_id=f"job-{name}").id, ""


def _two_arguments(h: Hostile, name: str) -> tuple[str, str]:
    run = h.create_run(f"run-{name}")
    payload = make_job(f"job-{name}", run=run).model_dump(mode="json")
    return h.queue().enqueue(TRAIN_FUNC, payload, "extra", job_id=f"job-{name}").id, run


def _unknown_keyword(h: Hostile, name: str) -> tuple[str, str]:
    run = h.create_run(f"run-{name}")
    payload = make_job(f"job-{name}", run=run).model_dump(mode="json")
    return h.queue().enqueue(TRAIN_FUNC, payload=payload, force=True, job_id=f"job-{name}").id, run


def _not_a_dict(h: Hostile, name: str) -> tuple[str, str]:
    return h.queue().enqueue(TRAIN_FUNC, ["not", "a", "job"], job_id=f"job-{name}").id, ""


def _pickled(h: Hostile, name: str) -> tuple[str, str]:
    run = h.create_run(f"run-{name}")
    payload = make_job(f"job-{name}", run=run).model_dump(mode="json")
    return h.queue(serializer=None).enqueue(TRAIN_FUNC, payload, job_id=f"job-{name}").id, ""  # pickle


def _garbage_data(h: Hostile, name: str) -> tuple[str, str]:
    return raw_job(h.conn, f"job-{name}", {"data": b"\x00\xffnot json at all"}), ""


def _garbage_fields(h: Hostile, name: str) -> tuple[str, str]:
    run = h.create_run(f"run-{name}")
    payload = make_job(f"job-{name}", run=run).model_dump(mode="json")
    fields = {"data": json_data(TRAIN_FUNC, [payload]), "created_at": "yesterday", "timeout": "soon",
              "retries_left": "many", "status": "whatever"}
    return raw_job(h.conn, f"job-{name}", fields), run


def _no_data(h: Hostile, name: str) -> tuple[str, str]:
    return raw_job(h.conn, f"job-{name}", {"description": "a hash with no job in it"}), ""


def _arguments_not_a_list(h: Hostile, name: str) -> tuple[str, str]:
    data = zlib.compress(json.dumps([TRAIN_FUNC, None, 5, {}]).encode())
    return raw_job(h.conn, f"job-{name}", {"data": data}), ""


def _keywords_not_a_mapping(h: Hostile, name: str) -> tuple[str, str]:
    run = h.create_run(f"run-{name}")
    payload = make_job(f"job-{name}", run=run).model_dump(mode="json")
    data = zlib.compress(json.dumps([TRAIN_FUNC, None, [payload], []]).encode())
    return raw_job(h.conn, f"job-{name}", {"data": data}), run


BAD_SHAPES = {
    "no_arguments": _no_arguments,
    "two_arguments": _two_arguments,
    "unknown_keyword": _unknown_keyword,
    "payload_not_a_dict": _not_a_dict,
    "pickled_payload": _pickled,
    "garbage_data": _garbage_data,
    "garbage_fields": _garbage_fields,
    "hash_without_data": _no_data,
    "arguments_not_a_list": _arguments_not_a_list,
    "keywords_not_a_mapping": _keywords_not_a_mapping,
}


@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_every_bad_job_fails_once_with_an_event_naming_it(case: str, hostile: Hostile) -> None:
    job_id, run = BAD_SHAPES[case](hostile, case.replace("_", "-"))

    assert hostile.wait_ended(job_id) == "failed"
    [event] = hostile.failed_events(job_id)  # exactly one: no retries
    assert event.run == run and event.data["retries_left"] == 0 and event.data["message"]
    if run:
        assert hostile.registry.latest_version(run) == 0
    hostile.assert_serves_next(case.replace("_", "-"))


def test_a_job_that_runs_out_of_its_time_is_not_retried(hostile: Hostile) -> None:
    """The same job would run out of its time again, and its client has given up on it by then: one
    attempt, a train_failed event with no retries left, and the worker takes the next job."""
    run = hostile.create_run("slow")
    job = make_job("slow-1", run=run, groups=16, size=16, prompt=200, completion=400)  # seconds on the CPU
    job_id = enqueue(hostile.conn, job.model_copy(update={"timeout_s": 1}))
    assert hostile.wait_ended(job_id) == "failed"
    time.sleep(2)  # a retry would have been queued by now
    assert hostile.status(job_id) == "failed"
    [event] = hostile.failed_events(job_id)
    assert event.data["retries_left"] == 0 and "timeout_s" in event.data["message"], event.data
    assert hostile.worker.log().count("job.timed_out job_id=slow-1") == 1
    hostile.assert_serves_next("after-timeout")
