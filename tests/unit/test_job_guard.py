"""The train queue's rq job class: it resolves no name but the trainer's job functions (the train
function and Tinker's three).

No Redis: a job is built or restored in memory (the client never connects).
"""

from __future__ import annotations

import json
import sys
import zlib

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from rq import Callback
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from tandem.errors import JobRefused
from tandem.jobs import JOB_FUNCS, TRAIN_FUNC, GuardedJob
from tandem.tinker_jobs import FORWARD_BACKWARD_FUNC, LOAD_STATE_FUNC, OPTIM_STEP_FUNC

pytestmark = pytest.mark.unit

CONN = redis.Redis(host="127.0.0.1", port=9)  # never used: nothing here talks to Redis
PAYLOAD = {"run": "r", "job_id": "j", "groups": []}


def created(func: str, *args: object, **options: object) -> GuardedJob:
    job = GuardedJob.create(func, args=list(args), connection=CONN, serializer=JSONSerializer, **options)
    assert isinstance(job, GuardedJob)
    return job


def restored(fields: dict[str, bytes]) -> GuardedJob:
    job = GuardedJob("a-job", connection=CONN, serializer=JSONSerializer)
    job.restore(fields)
    return job


def test_a_train_job_is_allowed() -> None:
    assert created(TRAIN_FUNC, PAYLOAD).refusal() is None
    job = GuardedJob.create(TRAIN_FUNC, kwargs={"payload": PAYLOAD}, connection=CONN, serializer=JSONSerializer)
    assert isinstance(job, GuardedJob) and job.refusal() is None
    assert job.named_run() == "r"


@pytest.mark.parametrize("func", [FORWARD_BACKWARD_FUNC, OPTIM_STEP_FUNC, LOAD_STATE_FUNC])
def test_a_job_of_tinkers_training_calls_is_allowed_with_one_payload(func: str) -> None:
    assert JOB_FUNCS == (TRAIN_FUNC, FORWARD_BACKWARD_FUNC, OPTIM_STEP_FUNC, LOAD_STATE_FUNC)
    job = created(func, PAYLOAD)
    assert job.refusal() is None and job.named_run() == "r"
    refusal = created(func, PAYLOAD, 1).refusal()
    assert refusal is not None and f"{func} takes one argument, the payload" in refusal
    with pytest.raises(JobRefused, match="callbacks are not allowed"):
        created(func, PAYLOAD, on_success=Callback("tandem_never_imported.hook")).func  # noqa: B018
    assert "tandem_never_imported" not in sys.modules


def test_a_name_beside_the_allowed_ones_is_refused() -> None:
    for func in ("tandem_trainer.worker.run_job", "tandem_trainer.worker._run_job", "tandem_trainer.worker.setup",
                 FORWARD_BACKWARD_FUNC + "x"):
        refusal = created(func, PAYLOAD).refusal()
        assert refusal is not None and f"function {func!r} is not allowed" in refusal and OPTIM_STEP_FUNC in refusal


def test_another_function_is_refused_and_never_imported() -> None:
    job = created("tandem_never_imported.module.run", "x")
    with pytest.raises(JobRefused, match=r"'tandem_never_imported.module.run' is not allowed.*" + TRAIN_FUNC):
        job.func  # noqa: B018 - resolving is what must fail
    assert "tandem_never_imported" not in sys.modules
    with pytest.raises(JobRefused, match="'os.system' is not allowed"):
        created("os.system", "touch /tmp/x").func  # noqa: B018


@pytest.mark.parametrize("which", ["on_success", "on_failure", "on_stopped"])
def test_a_callback_is_refused_and_never_resolved(which: str) -> None:
    job = created(TRAIN_FUNC, PAYLOAD, **{which: Callback("tandem_never_imported.hook")})
    with pytest.raises(JobRefused, match=f"callbacks are not allowed \\({which}='tandem_never_imported.hook'\\)"):
        job.func  # noqa: B018
    assert (job.success_callback, job.failure_callback, job.stopped_callback) == (None, None, None)
    assert "tandem_never_imported" not in sys.modules


@pytest.mark.parametrize(("args", "kwargs"), [([], {}), ([PAYLOAD, 1], {}), ([PAYLOAD], {"force": True}),
                                              ([], {"payload": PAYLOAD, "x": 1})])
def test_anything_but_one_payload_is_refused(args: list, kwargs: dict) -> None:
    job = GuardedJob.create(TRAIN_FUNC, args=args, kwargs=kwargs, connection=CONN, serializer=JSONSerializer)
    assert isinstance(job, GuardedJob)
    refusal = job.refusal()
    assert refusal is not None and "takes one argument, the payload" in refusal


@pytest.mark.parametrize(("args", "kwargs"), [(5, {}), (None, {}), ("x", {}), ({"payload": PAYLOAD}, {}),
                                              ([PAYLOAD], []), ([PAYLOAD], None), ([PAYLOAD], "payload"),
                                              ([], ["payload"])])
def test_arguments_of_the_wrong_type_are_refused_not_raised(args: object, kwargs: object) -> None:
    job = restored({"data": zlib.compress(json.dumps([TRAIN_FUNC, None, args, kwargs]).encode())})
    refusal = job.refusal()
    assert refusal is not None and "takes one argument, the payload" in refusal
    assert f"got {type(args).__name__} " in refusal and f" and {type(kwargs).__name__} " in refusal
    with pytest.raises(JobRefused):
        job.func  # noqa: B018
    job.payload()
    job.named_run()


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(JSON | st.lists(JSON, max_size=2), JSON | st.dictionaries(st.sampled_from(["payload", "x"]), JSON))
def test_any_arguments_either_are_one_payload_or_are_refused(args: object, kwargs: object) -> None:
    job = restored({"data": zlib.compress(json.dumps([TRAIN_FUNC, None, args, kwargs]).encode())})
    refusal = job.refusal()  # never raises, whatever the data holds
    if refusal is None:
        one_positional = isinstance(args, list) and len(args) == 1 and kwargs == {}
        assert one_positional or (args == [] and isinstance(kwargs, dict) and list(kwargs) == ["payload"])
    else:
        with pytest.raises(JobRefused):
            job.func  # noqa: B018
    job.payload()
    job.named_run()


def test_a_hash_rq_cannot_read_is_refused_not_raised() -> None:
    data = zlib.compress(json.dumps([TRAIN_FUNC, None, [PAYLOAD], {}]).encode())
    job = restored({"data": data, "created_at": b"yesterday", "origin": b"tandem-train"})
    refusal = job.refusal()
    assert refusal is not None and "rq cannot read the job's hash" in refusal and "yesterday" in refusal
    assert job.named_run() == "r"  # what can be read is still read, for the failure event
    assert restored({"description": b"no data"}).refusal() is not None
    assert restored({"data": b"\x80\x04pickle"}).refusal() is not None


RQ_FIELDS = ["data", "created_at", "origin", "status", "timeout", "result_ttl", "failure_ttl", "retries_left",
             "enqueued_at", "started_at", "ended_at", "meta", "dependency_ids", "success_callback_name",
             "failure_callback_name", "stopped_callback_name", "webhooks", "repeats_left", "retry_intervals",
             "description", "worker_name", "last_heartbeat", "number_of_retries", "rate_limit_key"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(RQ_FIELDS), st.binary(max_size=40) | st.sampled_from(
    [b"", b"0", b"-1", b"1e9", b"null", b"[]", b"{}", utcformat(now()).encode(), b"queued", b"os.system"])),
       st.sampled_from([*JOB_FUNCS, "os.system", "builtins.eval"]))
def test_any_job_hash_either_is_a_train_job_or_is_refused(fields: dict[str, bytes], func: str) -> None:
    if "data" not in fields:
        fields["data"] = zlib.compress(json.dumps([func, None, [PAYLOAD], {}]).encode())
    job = restored(fields)  # never raises, whatever the hash holds
    refusal = job.refusal()
    if refusal is None:
        assert job.func_name in JOB_FUNCS and job.instance is None
        assert not any(fields.get(f"{k}_callback_name") for k in ("success", "failure", "stopped"))
    else:
        with pytest.raises(JobRefused):
            job.func  # noqa: B018
    assert (job.success_callback, job.failure_callback, job.stopped_callback) == (None, None, None)
    job.to_dict()  # the worker saves a job when it ends: that must not raise either...
    if job.should_retry:
        job.get_retry_interval()  # ...nor finding when to retry it
