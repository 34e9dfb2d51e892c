"""The Tinker service driven by the real `tinker` SDK (0.38.0) on loopback: sessions, capabilities,
models as runs, training calls as trainer jobs in seq_id order, sampling through the real gateway
and the tiny model's engine, and every refusal in Tinker's error shape.

Redis is real (the service as the tandem-tinker user); the engine and gateway are the tiny model's.
"""

from __future__ import annotations

import gc
import json
import typing
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.servers import Servers
from helpers.tinker_service import API_KEY, tinker_service
from helpers.waiting import wait_until

from tandem import keys, tinker_jobs
from tandem.acl import Role
from tandem.registry import Registry

tinker = pytest.importorskip("tinker")
from tinker import types as tt  # noqa: E402

# NOTE: tinker 0.38.0's ServiceClient/RestClient leave sockets of their background event loop open
# after close() (ResourceWarning: unclosed transport); the SDK's, not the service's.
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

MAX_TOKENS = 8


@pytest.fixture
def url(servers: Servers, role_urls: dict[Role, str], redis_conn: redis.Redis) -> Iterator[str]:
    with tinker_service(role_urls[Role.TINKER], servers.gateway, poll_wait_s=0.2) as u:
        yield u


@pytest.fixture
def sdk(url: str) -> Iterator[Any]:
    client = tinker.ServiceClient(base_url=url, api_key=f"tml-{API_KEY}")
    yield client
    client.close("success").result()
    with warnings.catch_warnings():  # the SDK's leaked sockets (NOTE above), collected while ignored
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def queued(conn: redis.Redis) -> list[dict[str, Any]]:
    """The jobs on the train queue, in order: (func, payload)."""
    from tandem.jobs import train_queue

    q = train_queue(conn)
    return [{"func": j.func_name, "payload": j.args[0]} for j in q.get_jobs()]


def datum(tokens: list[int]) -> tt.Datum:
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def test_session_capabilities_and_create_model(url: str, sdk: Any, tiny_model: Path,
                                               redis_conn: redis.Redis) -> None:
    rest = tinker.RestClient(base_url=url, api_key=f"tml-{API_KEY}")
    try:
        caps = rest.get_server_capabilities().result()
    finally:
        rest.holder.run_coroutine_threadsafe(rest.holder.aclose()).result()
        del rest
    names = [m.model_name for m in caps.supported_models]
    assert str(tiny_model) in names
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    model_id = tc.model_id
    spec = Registry(redis_conn).get_run(model_id)  # a Tinker model is a tandem run
    assert spec.lora.r == 4 and spec.base_model == str(tiny_model)


def test_training_calls_are_jobs_in_seq_order(sdk: Any, tiny_model: Path, redis_conn: redis.Redis) -> None:
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    tc.forward_backward([datum([5, 6, 7, 8]), datum([9, 10, 11])], "cross_entropy")
    tc.optim_step(tt.AdamParams(learning_rate=1e-3))
    wait_until(lambda: len(queued(redis_conn)) == 2, 30, "the SDK's two pipelined requests on the train queue")
    jobs = queued(redis_conn)
    assert [j["func"] for j in jobs] == [tinker_jobs.FORWARD_BACKWARD_FUNC, tinker_jobs.OPTIM_STEP_FUNC]
    fb_job = tinker_jobs.ForwardBackwardJob.model_validate(jobs[0]["payload"])
    assert fb_job.run == tc.model_id and fb_job.loss_fn == "cross_entropy"
    assert [d.tokens for d in fb_job.datums] == [[5, 6, 7], [9, 10]]
    assert fb_job.datums[0].inputs["target_tokens"] == [6.0, 7.0, 8.0]
    opt = tinker_jobs.OptimStepJob.model_validate(jobs[1]["payload"])
    assert opt.gradients_from == [fb_job.job_id] and opt.adam.learning_rate == pytest.approx(1e-3)


def test_out_of_order_requests_wait_for_their_turn(url: str, sdk: Any, tiny_model: Path,
                                                   redis_conn: redis.Redis) -> None:
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    headers = {"X-API-Key": f"tml-{API_KEY}"}
    with httpx.Client(base_url=url, headers=headers) as http:
        step = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 2,
                                                     "adam_params": {"learning_rate": 1e-4}})
        assert step.status_code == 200
        assert queued(redis_conn) == []  # seq 2 waits for seq 1
        body = {"model_id": tc.model_id, "seq_id": 1, "forward_backward_input": {
            "loss_fn": "cross_entropy", "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]},
                                                  "loss_fn_inputs": {"target_tokens": {"data": [4, 5], "dtype": "int64"}}}]}}
        fb = http.post("/api/v1/forward_backward", json=body)
        assert fb.status_code == 200
        again = http.post("/api/v1/forward_backward", json=body)  # a retried POST: the same future
        assert again.json()["request_id"] == fb.json()["request_id"]
        pending = http.post("/api/v1/retrieve_future", json={"request_id": step.json()["request_id"]})
        assert pending.json()["type"] == "try_again"
    jobs = queued(redis_conn)
    assert [j["func"] for j in jobs] == [tinker_jobs.FORWARD_BACKWARD_FUNC, tinker_jobs.OPTIM_STEP_FUNC]
    assert jobs[1]["payload"]["gradients_from"] == [jobs[0]["payload"]["job_id"]]


def test_a_refused_training_call_does_not_hold_back_the_clients_next_calls(sdk: Any, tiny_model: Path,
                                                                           redis_conn: redis.Redis) -> None:
    # the SDK numbers every training call; a refused one still uses up its number, or each later call
    # would wait for it forever (the loop that catches a 422 and goes on would hang)
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    with pytest.raises(tinker.UnprocessableEntityError):
        tc.forward_backward([datum([4, 5, 6])], "no_such_loss").result()
    with pytest.raises(tinker.UnprocessableEntityError):
        tc.optim_step(tt.AdamParams(learning_rate=-1.0)).result()
    with pytest.raises(tinker.UnprocessableEntityError):
        tc.save_state("a/b").result()
    tc.forward_backward([datum([5, 6, 7, 8])], "cross_entropy")
    tc.optim_step(tt.AdamParams(learning_rate=1e-3))
    wait_until(lambda: len(queued(redis_conn)) == 2, 30, "the calls after the refused ones on the train queue")
    jobs = queued(redis_conn)
    assert [j["func"] for j in jobs] == [tinker_jobs.FORWARD_BACKWARD_FUNC, tinker_jobs.OPTIM_STEP_FUNC]
    assert jobs[1]["payload"]["gradients_from"] == [jobs[0]["payload"]["job_id"]]


def test_a_deleted_model_is_not_found_and_refusals_name_no_run_the_user_never_saw(
        url: str, sdk: Any, tiny_model: Path, redis_conn: redis.Redis) -> None:
    from tandem.deletion import delete_run

    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    with httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}) as http:
        assert http.post("/api/v1/get_info", json={"model_id": tc.model_id}).status_code == 200
        delete_run(redis_conn, tc.model_id)  # `tandem delete`
        gone = refusal(http.post("/api/v1/get_info", json={"model_id": tc.model_id}), 404)
    assert "was deleted" in gone["error"] and gone["param"] == "model_id"
    with pytest.raises(tinker.UnprocessableEntityError) as other:
        sdk.create_lora_training_client(base_model="Qwen/Nope-1B", rank=4).result()
    assert "Qwen/Nope-1B" in str(other.value) and "tinker-" not in str(other.value)
    with pytest.raises(tinker.UnprocessableEntityError) as other:
        sdk.create_sampling_client(base_model="Qwen/Nope-1B").result()
    assert "Qwen/Nope-1B" in str(other.value) and "'check'" not in str(other.value)


def test_compute_logprobs_is_refused_naming_itself_and_the_way_around(sdk: Any, tiny_model: Path) -> None:
    sc = sdk.create_sampling_client(base_model=str(tiny_model)).result()
    with pytest.raises(tinker.UnprocessableEntityError) as refused:
        sc.compute_logprobs(tt.ModelInput.from_ints([5, 6, 7, 8])).result()
    assert "compute_logprobs" in str(refused.value) and "forward(" in str(refused.value)


def test_sample_from_the_base_model(sdk: Any, tiny_model: Path) -> None:
    sc = sdk.create_sampling_client(base_model=str(tiny_model)).result()
    out = sc.sample(prompt=tt.ModelInput.from_ints([5, 6, 7, 8]), num_samples=2,
                    sampling_params=tt.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert 1 <= len(seq.tokens) <= 4
        assert len(seq.logprobs) == len(seq.tokens) and all(lp <= 0 for lp in seq.logprobs)
        assert seq.stop_reason in ("length", "stop")
    assert out.sequences[0].tokens == out.sequences[1].tokens  # greedy


def test_integer_stops_end_a_sample_at_that_token(sdk: Any, tiny_model: Path) -> None:
    """The cookbook's renderers stop on token ids (ChatML's end of turn): the sample ends with it."""
    sc = sdk.create_sampling_client(base_model=str(tiny_model)).result()
    prompt, greedy = tt.ModelInput.from_ints([5, 6, 7, 8]), tt.SamplingParams(max_tokens=6, temperature=0.0)
    free = sc.sample(prompt=prompt, num_samples=1, sampling_params=greedy).result().sequences[0].tokens
    assert len(free) == 6, free
    at = next(i for i, t in enumerate(free) if i >= 1 and t not in free[:i])
    stopped = sc.sample(prompt=prompt, num_samples=1,
                        sampling_params=tt.SamplingParams(max_tokens=6, temperature=0.0, stop=[free[at]])).result()
    assert stopped.sequences[0].tokens == free[:at + 1] and stopped.sequences[0].stop_reason == "stop"


def test_sampling_params_the_engine_cannot_serve_are_refused_by_name(sdk: Any, tiny_model: Path) -> None:
    sc = sdk.create_sampling_client(base_model=str(tiny_model)).result()
    for params, name in ((tt.SamplingParams(max_tokens=2, top_k=5), "top_k"),
                         (tt.SamplingParams(max_tokens=2, seed=3), "seed"),
                         (tt.SamplingParams(max_tokens=2, stop=[]), "stop")):
        with pytest.raises(Exception, match=name):
            sc.sample(prompt=tt.ModelInput.from_ints([5, 6]), num_samples=1, sampling_params=params).result()


def refusal(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) >= {"error", "category", "route"}
    return body


def test_refusals_in_tinkers_shape(url: str, sdk: Any, tiny_model: Path, redis_conn: redis.Redis) -> None:
    with httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}) as http:
        body = refusal(http.post("/api/v1/copy_weights", json={}), 404)
        assert "/api/v1/copy_weights" in body["error"] and "POST /api/v1/forward_backward" in body["supported"]
        assert "/nowhere" in refusal(http.get("/nowhere"), 404)["error"]
        unknown = refusal(http.post("/api/v1/optim_step", json={"model_id": "nope", "seq_id": 1,
                                                                "adam_params": {"learning_rate": 1e-4}}), 404)
        assert "nope" in unknown["error"] and unknown["param"] == "model_id"
        # the SDK sends NaN and infinity as null; raw JSON may carry them as numbers
        model_id = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result().model_id
        for seq, (lr, said) in enumerate(((b"NaN", "nan is not a finite number"), (b"1e400", "inf is not a finite number"),
                                          (b"null", "null is not a number (NaN and infinity reach the server as null)")),
                                         start=1):
            step = b'{"model_id": "%s", "seq_id": %d, "adam_params": {"learning_rate": %s}}' % (model_id.encode(), seq, lr)
            nan = refusal(http.post("/api/v1/optim_step", content=step, headers={"Content-Type": "application/json"}),
                          422)
            assert nan["param"] == "adam_params.learning_rate" and said in nan["error"], nan
        bad = refusal(http.post("/api/v1/forward_backward", content=b"\xff\x00garbage",
                                headers={"Content-Type": "application/x-protobuf"}), 422)
        assert "ForwardBackwardRequest" in bad["error"]
        for fbi, param in (({"data": "x", "loss_fn": "cross_entropy"}, "forward_backward_input.data"),
                           ({"data": ["x"], "loss_fn": "cross_entropy"}, "data.0"), ("x", "forward_backward_input"),
                           ({"data": [], "loss_fn": "cross_entropy", "loss_fn_config": [1]},
                            "forward_backward_input.loss_fn_config")):
            shaped = refusal(http.post("/api/v1/forward_backward", json={
                "model_id": "any", "seq_id": 1, "forward_backward_input": fbi}), 422)
            assert shaped["param"] == param, shaped
        shape = refusal(http.post("/api/v1/create_model", json={"session_id": "s", "base_model": 3}), 422)
        assert shape["param"]
        assert "request_id" in refusal(http.post("/api/v1/retrieve_future", json={"request_id": "req-x"}), 404)["param"]
        # another sampling session's future is not this session's
        sessions = []
        for _ in range(2):
            sid = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": None,
                                                            "sdk_version": "t"}).json()["session_id"]
            s = http.post("/api/v1/create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 0,
                                                                   "base_model": str(tiny_model)})
            sessions.append(s.json()["sampling_session_id"])
        sample = http.post("/api/v1/asample", json={
            "sampling_session_id": sessions[0], "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
            "sampling_params": {"max_tokens": 2, "temperature": 0}})
        assert sample.status_code == 200, sample.text
        for tokens, max_tokens, param in (([5] * 1020, 8, "sampling_params.max_tokens"), ([5] * 1030, 2, "prompt")):
            long = http.post("/api/v1/asample", json={
                "sampling_session_id": sessions[0], "seq_id": 1, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0}})
            body = long.json() if long.status_code != 200 else http.post(
                "/api/v1/retrieve_future", json={"request_id": long.json()["request_id"]}).json()
            assert "context length 1024" in body["error"] and body.get("param") == param, body
        outside = http.post("/api/v1/asample", json={  # a stop token id outside the vocabulary
            "sampling_session_id": sessions[0], "seq_id": 2, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
            "sampling_params": {"max_tokens": 2, "temperature": 0, "stop": [99999]}})
        body = outside.json() if outside.status_code != 200 else http.post(
            "/api/v1/retrieve_future", json={"request_id": outside.json()["request_id"]}).json()
        assert body.get("param") == "sampling_params.stop" and "[99999] are outside the vocabulary" in body["error"]
        assert "(400)" not in body["error"] and "(422)" not in body["error"], body
        foreign = http.post("/api/v1/retrieve_futures", json={
            "target": {"type": "sampling_session", "sampling_session_id": sessions[1]},
            "retrieved_request_ids": [sample.json()["request_id"]]})
        assert "not futures of sampling session" in refusal(foreign, 404)["error"]
    with httpx.Client(base_url=url) as http:
        assert refusal(http.post("/api/v1/create_session", json={}), 401)["category"] == "user"
    # nothing was lost: no job was enqueued by any refusal
    assert queued(redis_conn) == []
    assert json.loads(json.dumps(keys.TINKER))


def test_a_zstd_protobuf_forward_backward_is_read_and_bad_zstd_refused(url: str, sdk: Any, tiny_model: Path,
                                                                      redis_conn: redis.Redis) -> None:
    import zstandard
    from tinker.proto.request_conv import forward_backward_request_to_proto

    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(data=[datum([4, 5, 6])], loss_fn="importance_sampling",
                                                       loss_fn_config={"clip_low_threshold": 0.8}),
        model_id=tc.model_id, seq_id=1)
    proto = forward_backward_request_to_proto(request).SerializeToString()
    headers = {"X-API-Key": f"tml-{API_KEY}", "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    with httpx.Client(base_url=url, headers=headers) as http:
        bad = refusal(http.post("/api/v1/forward_backward", content=b"not zstd"), 422)
        assert "zstd" in bad["error"]
        assert queued(redis_conn) == []
        ok = http.post("/api/v1/forward_backward", content=zstandard.ZstdCompressor().compress(proto))
        assert ok.status_code == 200, ok.text
    (job,) = queued(redis_conn)
    fb = tinker_jobs.ForwardBackwardJob.model_validate(job["payload"])
    assert fb.loss_fn == "importance_sampling" and fb.loss_fn_config == {"clip_low_threshold": pytest.approx(0.8)}
    assert fb.datums[0].tokens == [4, 5] and fb.datums[0].inputs["target_tokens"] == [5.0, 6.0]


#: Every loss the pinned SDK can name that tandem's trainer does not compute (`tt.LossFnType`).
UNSERVED_LOSSES = [name for name in typing.get_args(tt.LossFnType) if name not in tinker_jobs.LOSSES]


def test_the_sdk_names_losses_tandem_refuses() -> None:
    assert set(UNSERVED_LOSSES) >= {"stable_reinforce", "custom"}  # the SDK's list is read, not made up here


@pytest.mark.parametrize("loss_fn", UNSERVED_LOSSES)
def test_a_loss_tandem_does_not_compute_is_refused_naming_the_supported_ones(
        url: str, sdk: Any, tiny_model: Path, redis_conn: redis.Redis, loss_fn: str) -> None:
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    config = {"loss_id": "mine"} if loss_fn == "custom" else None  # what the SDK sends for an uploaded loss
    with pytest.raises(tinker.UnprocessableEntityError) as refused:
        tc.forward_backward([datum([4, 5, 6])], loss_fn, config).result()
    message = str(refused.value)
    assert refused.value.status_code == 422 and f"loss_fn {loss_fn!r} is not supported" in message
    assert all(name in message for name in tinker_jobs.LOSSES) and "forward_backward_custom" in message
    # the JSON form of the request is refused the same way
    body = {"model_id": tc.model_id, "seq_id": 7, "forward_backward_input": {"loss_fn": loss_fn, "data": []}}
    with httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}) as http:
        refused_json = refusal(http.post("/api/v1/forward_backward", json=body), 422)
    assert refused_json["param"] == "loss_fn" and all(name in refused_json["error"] for name in tinker_jobs.LOSSES)
    assert queued(redis_conn) == []  # nothing reached the trainer


FB_JSON = {"loss_fn": "cross_entropy", "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]},
                                                 "loss_fn_inputs": {"target_tokens": {"data": [4, 5], "dtype": "int64"}}}]}


def test_a_seq_id_that_is_no_sequence_number_is_refused_naming_it(url: str, sdk: Any, tiny_model: Path,
                                                                 redis_conn: redis.Redis) -> None:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    model_id = tc.model_id
    bodies = {"/api/v1/forward_backward": {"model_id": model_id, "forward_backward_input": FB_JSON},
              "/api/v1/optim_step": {"model_id": model_id, "adam_params": {"learning_rate": 1e-4}},
              "/api/v1/save_weights": {"model_id": model_id, "path": "w"},
              "/api/v1/save_weights_for_sampler": {"model_id": model_id, "path": "s"}}
    with httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}) as http:  # one keep-alive connection
        for route, body in bodies.items():
            for seq_id in (-5, "abc", 2**70):
                if route != "/api/v1/forward_backward" and seq_id == "abc":
                    continue  # the SDK's own type refuses it (a 422 naming seq_id already)
                bad = refusal(http.post(route, json={**body, "seq_id": seq_id}), 422)
                assert bad["param"] == "seq_id" and repr(seq_id) in bad["error"], (route, bad)
                # the connection is still good: the next request on it is answered
                assert http.post("/api/v1/get_info", json={"model_id": model_id}).status_code == 200
        # the protobuf form carries an int32: a negative one is refused too
        proto = forward_backward_request_to_proto(tt.ForwardBackwardRequest(
            forward_backward_input=tt.ForwardBackwardInput(data=[datum([4, 5, 6])], loss_fn="cross_entropy"),
            model_id=model_id, seq_id=-5)).SerializeToString()
        bad = refusal(http.post("/api/v1/forward_backward", content=proto,
                                headers={"Content-Type": "application/x-protobuf"}), 422)
        assert bad["param"] == "seq_id" and "-5" in bad["error"]
        assert queued(redis_conn) == []
        # a refusal of another field uses up its (good) seq_id; the refused seq_ids named no turn
        empty = {"model_id": model_id, "seq_id": 1, "forward_backward_input": {**FB_JSON, "data": []}}
        assert refusal(http.post("/api/v1/forward_backward", json=empty), 422)["param"] == "data"
        ok = http.post("/api/v1/forward_backward", json={**bodies["/api/v1/forward_backward"], "seq_id": 2})
        assert ok.status_code == 200, ok.text
        ok = http.post("/api/v1/optim_step", json={**bodies["/api/v1/optim_step"], "seq_id": 3})
        assert ok.status_code == 200, ok.text
    assert [j["func"] for j in queued(redis_conn)] == [tinker_jobs.FORWARD_BACKWARD_FUNC, tinker_jobs.OPTIM_STEP_FUNC]


def test_every_training_call_on_a_deleted_model_is_404_at_once_and_queues_nothing(
        url: str, sdk: Any, tiny_model: Path, redis_conn: redis.Redis) -> None:
    from tandem.deletion import delete_run

    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    delete_run(redis_conn, tc.model_id)  # `tandem delete`
    calls = {"forward_backward": lambda: tc.forward_backward([datum([4, 5, 6])], "cross_entropy"),
             "optim_step": lambda: tc.optim_step(tt.AdamParams(learning_rate=1e-4)),
             "save_state": lambda: tc.save_state("w"),
             "save_weights_for_sampler": lambda: tc.save_weights_for_sampler("s")}
    for name, call in calls.items():
        with pytest.raises(tinker.NotFoundError) as gone:
            call().result(timeout=30)
        assert tc.model_id in str(gone.value) and "was deleted" in str(gone.value), name
    assert queued(redis_conn) == []

    # a call that arrived before the deletion and waits for its turn: the refusal of the call before it
    # uses up that one's turn, and the waiting one fails when its turn comes, nothing queued
    other = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    with httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}) as http:
        waiting = http.post("/api/v1/optim_step", json={"model_id": other.model_id, "seq_id": 2,
                                                        "adam_params": {"learning_rate": 1e-4}})
        assert waiting.status_code == 200, waiting.text
        delete_run(redis_conn, other.model_id)
        first = http.post("/api/v1/forward_backward", json={"model_id": other.model_id, "seq_id": 1,
                                                             "forward_backward_input": FB_JSON})
        assert refusal(first, 404)["param"] == "model_id"
        answer = http.post("/api/v1/retrieve_future", json={"request_id": waiting.json()["request_id"]}).json()
    assert answer["category"] == "user" and "was deleted" in answer["error"], answer
    assert queued(redis_conn) == []


def test_a_deleted_models_checkpoints_are_not_found_at_once(url: str, sdk: Any, tiny_model: Path,
                                                            redis_conn: redis.Redis) -> None:
    import time

    from tandem.adapters import Manifest
    from tandem.deletion import delete_run

    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    sampler_path = tc.save_weights_for_sampler("s").result(timeout=30).path  # names version 0
    opened = sdk.create_sampling_client(model_path=sampler_path).result()
    # the trainer's publication of version 1 (no trainer here), which save_state then names
    Registry(redis_conn).register_version(Manifest(run=tc.model_id, version=1, parent=0, step=1, job_id="j1",
                                                   base_model=str(tiny_model), lora_rank=4))
    state_path = tc.save_state("w").result(timeout=30).path
    delete_run(redis_conn, tc.model_id)  # `tandem delete`
    started = time.monotonic()
    prompt, params = tt.ModelInput.from_ints([5, 6]), tt.SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(tinker.NotFoundError) as sampling:
        sdk.create_sampling_client(model_path=sampler_path).result(timeout=30).sample(prompt, 1, params).result(timeout=30)
    with pytest.raises(tinker.NotFoundError) as loading:
        sdk.create_training_client_from_state(state_path).result(timeout=30)
    with pytest.raises(tinker.NotFoundError) as sampled:  # a sampler opened before the deletion
        opened.sample(prompt, 1, params).result(timeout=30)
    assert time.monotonic() - started < 20  # a 404 is final: the SDK did not retry for a minute
    for refused, path in ((sampling, sampler_path), (loading, state_path), (sampled, sampler_path)):
        assert path in str(refused.value) and "deleted" in str(refused.value)
    with httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}) as http:
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": None,
                                                            "sdk_version": "t"}).json()["session_id"]
        body = refusal(http.post("/api/v1/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 0, "model_path": sampler_path}), 404)
    assert body["param"] == "path" and sampler_path in body["error"] and "known runs" not in body["error"]
    assert queued(redis_conn) == []


def test_json_nested_past_the_parser_is_a_422_and_the_connection_goes_on(url: str, sdk: Any, tiny_model: Path,
                                                                        redis_conn: redis.Redis) -> None:
    deep = b"[" * 5000 + b"]" * 5000
    with httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}", "Content-Type": "application/json"}) as http:
        for route in ("/api/v1/get_info", "/api/v1/create_model", "/api/v1/forward_backward", "/api/v1/asample"):
            body = refusal(http.post(route, content=deep), 422)
            assert body["param"] == "body" and "nested too deeply" in body["error"], route
        assert http.get("/api/v1/healthz").status_code == 200  # the same keep-alive connection
    assert queued(redis_conn) == []


@pytest.mark.parametrize(("tensor", "says"), [
    ({"data": [4, 5], "dtype": "int64", "shape": [1000]}, "has shape [1000] for 2 values"),
    ({"data": [4, 5], "dtype": "int64", "shape": [1, 2]}, "has shape [1, 2] for 2 values"),
    ({"data": [4, 5], "dtype": "complex"}, "has dtype 'complex'"),
    ({"data": [4.5, 5], "dtype": "int64"}, "is int64 but holds a fraction"),
    ({"data": [4, 5]}, "has dtype None"),
    ({"data": [4, 5], "dtype": "int64", "shape": [2], "sparse_crow_indices": [0, 2]}, "is sparse"),
    ([4, 5], "is not a TensorData"),
])
def test_a_json_loss_input_that_is_no_dense_tensor_of_one_value_per_token_is_refused_naming_it(
        url: str, sdk: Any, tiny_model: Path, redis_conn: redis.Redis, tensor: Any, says: str) -> None:
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    fbi = json.loads(json.dumps(FB_JSON))
    fbi["data"][0]["loss_fn_inputs"]["target_tokens"] = tensor
    with httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}) as http:
        body = refusal(http.post("/api/v1/forward_backward", json={"model_id": tc.model_id, "seq_id": 1,
                                                                   "forward_backward_input": fbi}), 422)
        assert body["param"] == "data.0.loss_fn_inputs.target_tokens" and says in body["error"], body
        image = {"model_id": tc.model_id, "seq_id": 2, "forward_backward_input": {**FB_JSON, "data": [
            {**FB_JSON["data"][0], "model_input": {"chunks": [{"type": "image", "data": "xx", "format": "png"}]}}]}}
        assert "is a 'image' chunk" in refusal(http.post("/api/v1/forward_backward", json=image), 422)["error"]
    assert queued(redis_conn) == []


def test_a_gateway_that_is_away_is_a_503_the_sdk_retries_not_the_callers_mistake(
        role_urls: dict[Role, str], redis_conn: redis.Redis, tiny_model: Path) -> None:
    """While inference restarts, creating a model or a sampler cannot ask the gateway which model it
    serves: a 503 of category server (the SDK retries 5xx), never a 422 blaming base_model."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with tinker_service(role_urls[Role.TINKER], f"http://127.0.0.1:{closed}") as url, \
            httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}) as http:
        sid = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": None,
                                                        "sdk_version": "t"}).json()["session_id"]
        for route, body in (("/api/v1/create_model", {"session_id": sid, "model_seq_id": 0,
                                                      "base_model": str(tiny_model), "lora_config": {"rank": 4}}),
                            ("/api/v1/create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0,
                                                                 "base_model": str(tiny_model)})):
            answer = refusal(http.post(route, json=body), 503)
            assert answer["category"] == "server" and "did not say which model it serves" in answer["error"], route
    assert Registry(redis_conn).list_runs() == []  # no model was made


def test_a_used_seq_id_answers_a_resend_of_its_call_and_refuses_another_call(
        url: str, sdk: Any, tiny_model: Path, redis_conn: redis.Redis) -> None:
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    other = json.loads(json.dumps(FB_JSON))
    other["data"][0]["model_input"]["chunks"][0]["tokens"] = [7, 8]
    fb = {"model_id": tc.model_id, "seq_id": 1, "forward_backward_input": FB_JSON}
    with httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{API_KEY}"}) as http:
        first = http.post("/api/v1/forward_backward", json=fb).json()["request_id"]
        assert http.post("/api/v1/forward_backward", json=fb).json()["request_id"] == first  # a resend
        for route, body in (("/api/v1/forward_backward", {**fb, "forward_backward_input": other}),
                            ("/api/v1/optim_step", {"model_id": tc.model_id, "seq_id": 1,
                                                    "adam_params": {"learning_rate": 1e-3}})):
            answer = refusal(http.post(route, json=body), 422)
            assert answer["param"] == "seq_id" and "was used by an earlier forward_backward call" in answer["error"]
        step = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 2,
                                                     "adam_params": {"learning_rate": 1e-3}})
        assert step.status_code == 200 and step.json()["request_id"] != first  # the next turn goes on
    assert [job["func"].rsplit(".", 1)[-1] for job in queued(redis_conn)] == ["run_forward_backward_job",
                                                                            "run_optim_step_job"]
