"""Only tandem errors leave the client: odd gateway answers and bad user input, at the network edge.

The gateway is an `httpx.MockTransport`; Redis is a client for a port nothing listens on, so any
call that reached it would fail with a redis-py error (none must).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis
from helpers.loopback import free_port

from tandem import Client, Completion, Origin, Run
from tandem.errors import ConfigError, GatewayError, TandemError, ValidationFailed
from tandem.runs import RunSpec, same_base_model

pytestmark = pytest.mark.unit

GATEWAY = "http://gateway.test"


def client_with(handler: Callable[[httpx.Request], httpx.Response]) -> Client:
    http = httpx.Client(base_url=GATEWAY, transport=httpx.MockTransport(handler))
    return Client(GATEWAY, http=http, conn=redis.Redis(port=free_port(), socket_connect_timeout=1))


def answering(status: int, body: Any) -> Client:
    def handler(_: httpx.Request) -> httpx.Response:
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    return client_with(handler)


def chat(client: Client) -> list[Completion]:
    return Run(client, RunSpec(name="r", base_model="m")).chat([{"role": "user", "content": "hi"}], n=2)


ODD_ANSWERS = {
    "200 not JSON": (200, "<html>hello</html>"),
    "200 a JSON list": (200, [1, 2]),
    "200 without tandem's extension": (200, {"choices": [{"message": {"content": "x"}}]}),
    "200 with a short extension": (200, {"choices": [{"message": {"content": "x"}}, {"message": {"content": "y"}}],
                                         "tandem": {"prompt_token_ids": [1], "completion_token_ids": [[2]],
                                                    "completion_logprobs": [[-0.1]], "version": 0}}),
    "200 with choices not a list": (200, {"choices": 3, "tandem": {}}),
    "200 with token ids not numbers": (200, {"choices": [{"message": {"content": "x"}}],
                                             "tandem": {"prompt_token_ids": [1], "completion_token_ids": [["a"]],
                                                        "completion_logprobs": [[-0.1]], "version": 0}}),
    "200 with a version not a number": (200, {"choices": [{"message": {"content": "x"}}],
                                              "tandem": {"prompt_token_ids": [1], "completion_token_ids": [[2]],
                                                         "completion_logprobs": [[-0.1]], "version": "new"}}),
    "400 with error a string": (400, {"error": "bad request"}),
    "404 with a list": (404, ["nope"]),
    "500 not JSON": (500, "Internal Server Error"),
}


@pytest.mark.parametrize(("status", "body"), ODD_ANSWERS.values(), ids=ODD_ANSWERS.keys())
def test_an_odd_gateway_answer_is_a_gateway_error(status: int, body: Any) -> None:
    with pytest.raises(GatewayError) as info:
        chat(answering(status, body))
    assert info.value.status_code == status and "/v1/chat/completions" in str(info.value)
    if status == 400:
        assert "bad request" in str(info.value)


def test_a_refused_connection_is_backend_unavailable_naming_the_gateway() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(TandemError, match=GATEWAY):
        chat(client_with(refuse))


def models(root: str | None, served: str = "base") -> Client:
    return answering(200, {"object": "list", "data": [
        {"id": served, "object": "model", "root": root}, {"id": "some-run", "object": "model", "root": None},
    ]})


def test_create_run_on_another_model_is_refused_before_anything_is_registered() -> None:
    with pytest.raises(ValidationFailed) as info:
        models("/models/tiny").create_run("r", base_model="/models/small")
    assert "'/models/small'" in str(info.value) and "'/models/tiny'" in str(info.value)
    assert info.value.field == "base_model"


BAD_RUNS: dict[str, dict[str, Any]] = {
    "name with a colon": {"name": "a:b", "base_model": "m"},
    "empty base model": {"name": "r", "base_model": "  "},
    "staleness out of range": {"name": "r", "base_model": "m", "max_staleness_steps": 1000},
}


@pytest.mark.parametrize("kwargs", BAD_RUNS.values(), ids=BAD_RUNS.keys())
def test_a_bad_run_is_validation_failed(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValidationFailed):
        models("m").create_run(**kwargs)


def completion(n_tokens: int = 1) -> Completion:
    return Completion(text="x", prompt_ids=[1], completion_ids=[2] * n_tokens, rollout_logprobs=[-0.1] * n_tokens,
                      version=0)


BAD_GROUPS: dict[str, tuple[list[Completion], list[Any], str, str]] = {
    "more rewards than completions": ([completion(), completion()], [1.0, 0.0, 1.0], "rewards", "3 rewards"),
    "one completion": ([completion()], [1.0], "completions", "at least 2"),
    "reward not finite": ([completion(), completion()], [1.0, float("nan")], "rewards", "rewards[1] is nan"),
    "reward infinite": ([completion(), completion()], [float("-inf"), 1.0], "rewards", "rewards[0] is -inf"),
    # pydantic took "1" and True for 1.0
    "reward a string": ([completion(), completion()], ["1", 0.0], "rewards", "rewards[0] is '1'"),
    "reward a bool": ([completion(), completion()], [0.0, True], "rewards", "rewards[1] is True"),
}


@pytest.mark.parametrize(("completions", "rewards", "field", "said"), BAD_GROUPS.values(), ids=BAD_GROUPS.keys())
def test_a_bad_group_is_validation_failed_naming_the_field(completions: list[Completion], rewards: list[Any],
                                                          field: str, said: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        Run.group(completions, rewards)
    assert info.value.field == field and said in str(info.value)


def test_train_with_no_groups_is_validation_failed_before_redis_is_asked() -> None:
    run = Run(answering(200, {}), RunSpec(name="r", base_model="m"))
    with pytest.raises(ValidationFailed, match="no groups"):
        run.train([], wait=False)


@pytest.mark.parametrize("timeout_s", [0, -5, float("inf")])
def test_a_train_timeout_that_is_no_wait_is_validation_failed_before_redis_is_asked(timeout_s: float) -> None:
    """0 used to mean "the default" for the job while the caller's wait timed out at once: the
    job trained on, and a caller who retried trained the step twice. (A short wait, 0.4 s, is one:
    a job not started when it ends is cancelled, one running is TrainTimeout.running.)"""
    run = Run(answering(200, {}), RunSpec(name="r", base_model="m"))
    group = Run.group([completion(), completion()], [1.0, 0.0])
    with pytest.raises(ValidationFailed) as info:
        run.train([group], timeout_s=timeout_s)
    assert info.value.field == "timeout_s"


SAME = [
    ("/models/Qwen/Qwen2.5-0.5B-Instruct", "/models/Qwen/Qwen2.5-0.5B-Instruct/", None),
    ("Qwen/Qwen2.5-0.5B-Instruct", "/models/Qwen/Qwen2.5-0.5B-Instruct", None),
    ("Qwen/Qwen2.5-0.5B-Instruct",
     "/root/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/abc123", None),
    ("/models/Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", None),
    ("Qwen/Qwen2.5-0.5B-Instruct", "/models/q", "Qwen/Qwen2.5-0.5B-Instruct"),
]
DIFFERENT = [
    ("Qwen/Qwen2.5-0.5B", "/models/Qwen/Qwen2.5-0.5B-Instruct", "base"),
    ("other/Qwen2.5-0.5B-Instruct", "/models/Qwen/Qwen2.5-0.5B-Instruct", "base"),
    ("/models/a", "/models/b", "base"),
    ("Qwen/A", "Qwen/B", "base"),
]


@pytest.mark.parametrize(("wanted", "model", "served"), SAME)
def test_same_base_model_accepts_comparable_forms(wanted: str, model: str, served: str | None) -> None:
    assert same_base_model(wanted, model, served)


@pytest.mark.parametrize(("wanted", "model", "served"), DIFFERENT)
def test_same_base_model_refuses_other_models(wanted: str, model: str, served: str | None) -> None:
    assert not same_base_model(wanted, model, served)


def test_the_request_body_is_json() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"content": "a"}}, {"message": {"content": "b"}}],
                                         "tandem": {"prompt_token_ids": [1], "completion_token_ids": [[2], [3]],
                                                    "completion_logprobs": [[-0.1], [-0.2]], "version": 4,
                                                    "temperature": 1.0}})

    out = chat(client_with(handler))
    assert [c.text for c in out] == ["a", "b"] and out[1].completion_ids == [3] and out[0].version == 4
    assert seen[0]["model"] == "r" and seen[0]["n"] == 2


def sampled_by(run: str, version: int) -> Client:
    """A gateway whose replies say that `run`'s `version` sampled them, as tandem's does."""
    adapter = f"{run}-v{version}" if version else None
    return answering(200, {"choices": [{"message": {"content": "a"}}, {"message": {"content": "b"}}],
                           "tandem": {"run": run, "version": version, "adapter": adapter, "prompt_token_ids": [1],
                                      "completion_token_ids": [[2], [3]], "completion_logprobs": [[-0.1], [-0.2]],
                                      "temperature": 1.0}})


def test_completions_keep_the_run_and_adapter_the_gateway_said_sampled_them() -> None:
    out = chat(sampled_by("alpha", 2))
    assert [c.origin for c in out] == [Origin(run="alpha", adapter="alpha-v2")] * 2
    assert Run.group(out, [1.0, 0.0]).trajectories[1].origin == Origin(run="alpha", adapter="alpha-v2")


def test_training_one_run_on_anothers_completions_is_refused_before_redis_is_asked() -> None:
    """Redis is a dead port here: the refusal comes before anything is enqueued."""
    completions = Run(sampled_by("alpha", 2), RunSpec(name="alpha", base_model="m")).chat(
        [{"role": "user", "content": "hi"}], n=2)
    beta = Run(answering(200, {}), RunSpec(name="beta", base_model="m"))
    with pytest.raises(ValidationFailed) as info:
        beta.train([Run.group(completions, [1.0, 0.0])], wait=False)
    assert info.value.field == "groups.0.trajectories.0.origin.run"
    assert "group 0 sample 0 was sampled from run 'alpha' (v2); this job trains run 'beta'" in str(info.value)


@pytest.mark.parametrize("url", ["localhost:6379", "http://127.0.0.1:6379/0", "redis://:pw@127.0.0.1:port/0"])
def test_a_redis_url_that_cannot_work_is_config_error_naming_it_without_its_password(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        Client(GATEWAY, url)
    message = str(info.value)
    assert "TANDEM_REDIS__URL" in message and ":pw@" not in message
    assert url.replace(":pw@", ":***@") in message
