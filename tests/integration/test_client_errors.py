"""No client error is a 5xx: the gateway and the engine answer bad input with an OpenAI-shaped
4xx naming the field and the limit, and keep the connection for the next request.

Also: top logprobs are listed when asked for (chat `top_logprobs`, completions `logprobs: k`,
native `top_logprobs_num`), and out-of-range counts are refused rather than dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.servers import BASE, Servers

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "What is 2 plus 2?"}]
CONTEXT = 1024  # the tiny model's


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """One client, so that a request after a refused one reuses its connection."""
    with httpx.Client(timeout=120) as client:
        yield client


def post_raw(http: httpx.Client, url: str, raw: str) -> httpx.Response:
    return http.post(url, content=raw.encode(), headers={"content-type": "application/json"})


def assert_client_error(response: httpx.Response, status: int, *words: str, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    if param is not None:
        assert error["param"] == param, error


def still_serves(http: httpx.Client, url: str) -> None:
    """The connection the refusal went over still carries a request (it was not closed on a crash)."""
    response = http.post(url, json={"model": BASE, "messages": CHAT, "max_tokens": 2})
    assert response.status_code == 200, response.text


def url_of(servers: Servers, where: str, path: str) -> str:
    return f"{servers.gateway if where == 'gateway' else servers.engine}{path}"


@pytest.mark.parametrize("where", ["gateway", "engine"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_non_finite_numbers_are_422_and_the_connection_stays(
    servers: Servers, http: httpx.Client, where: str, literal: str, field: str
) -> None:
    url = url_of(servers, where, "/v1/chat/completions")
    raw = f'{{"model": "{BASE}", "messages": {json.dumps(CHAT)}, "max_tokens": 2, "{field}": {literal}}}'
    assert_client_error(post_raw(http, url, raw), 422, field, "finite", param=field)
    still_serves(http, url)


def test_non_finite_numbers_in_native_sampling_params_are_422(servers: Servers, http: httpx.Client) -> None:
    raw = '{"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": NaN}}'
    assert_client_error(post_raw(http, f"{servers.engine}/generate", raw), 422, "temperature", "finite")


LONE_SURROGATES = [
    ("/v1/chat/completions", '{"model": "base", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/v1/chat/completions", '{"model": "base", "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": "\\udfff"}]}]}', "messages"),
    ("/v1/completions", '{"model": "base", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "base", "prompt": "ab", "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", '{"model": "ba\\udc00se", "prompt": "ab"}', "model"),
]


@pytest.mark.parametrize("where", ["gateway", "engine"])
@pytest.mark.parametrize(("path", "raw", "field"), LONE_SURROGATES)
def test_lone_surrogates_are_422_naming_the_field(
    servers: Servers, http: httpx.Client, where: str, path: str, raw: str, field: str
) -> None:
    response = post_raw(http, url_of(servers, where, path), raw)
    assert_client_error(response, 422, field, "lone surrogate", param=field)
    still_serves(http, url_of(servers, where, "/v1/chat/completions"))


@pytest.mark.parametrize(("extra", "words"), [
    ('"user": "a\\ud800"', ("user", "lone surrogate")),
    ('"metadata": {"k": NaN}', ("metadata.k", "finite")),
    ('"metadata": {"k": Infinity}', ("metadata.k", "finite")),
])
def test_fields_the_gateway_does_not_read_are_held_to_the_same_rule(
    servers: Servers, http: httpx.Client, extra: str, words: tuple[str, ...]
) -> None:
    """`user` and `metadata` change nothing of the reply, but they were let through unchecked."""
    url = url_of(servers, "gateway", "/v1/chat/completions")
    raw = f'{{"model": "{BASE}", "messages": {json.dumps(CHAT)}, "max_tokens": 2, {extra}}}'
    assert_client_error(post_raw(http, url, raw), 422, *words)
    still_serves(http, url)


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", '"5"'), ("stream", '"yes"'), ("n", "true"), ("logprobs", '"true"'), ("max_tokens", "5.5"),
])
def test_a_value_of_the_wrong_type_is_refused_not_converted(
    servers: Servers, http: httpx.Client, field: str, value: str
) -> None:
    url = url_of(servers, "gateway", "/v1/chat/completions")
    raw = f'{{"model": "{BASE}", "messages": {json.dumps(CHAT)}, "{field}": {value}}}'
    assert_client_error(post_raw(http, url, raw), 422, field, param=field)


def test_a_prompt_that_fits_without_max_tokens_gets_the_room_left_not_a_refusal(
    servers: Servers, http: httpx.Client
) -> None:
    """The default of 128 new tokens would overflow the context; OpenAI's rule is the rest of it."""
    url = url_of(servers, "gateway", "/v1/completions")
    reply = http.post(url, json={"model": BASE, "prompt": [5] * (CONTEXT - 6), "temperature": 1.0})
    assert reply.status_code == 200, reply.text
    assert 1 <= reply.json()["usage"]["completion_tokens"] <= 6
    asked = http.post(url, json={"model": BASE, "prompt": [5] * (CONTEXT - 6), "max_tokens": 60})
    assert_client_error(asked, 400)  # one that names max_tokens is held to it


def test_lone_surrogates_in_native_text_and_rid_are_422(servers: Servers, http: httpx.Client) -> None:
    for raw, field in (('{"text": "a\\ud800"}', "text"), ('{"text": "a", "rid": "\\ud800"}', "rid")):
        assert_client_error(post_raw(http, f"{servers.engine}/generate", raw), 422, field, "lone surrogate")


@pytest.mark.parametrize("where", ["gateway", "engine"])
@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hello world " * 90_000, "max_tokens": 2},  # about 1 MB of text
        {"prompt": [5] * 100_000, "max_tokens": 2},
        {"prompt": [5] * (CONTEXT - 10), "max_tokens": 60},  # fits alone, not with max_tokens
    ],
    ids=["1MB-text", "100k-ids", "prompt+max_tokens"],
)
def test_prompts_longer_than_the_context_are_400_naming_the_limit(
    servers: Servers, http: httpx.Client, where: str, body: dict[str, Any]
) -> None:
    response = http.post(url_of(servers, where, "/v1/completions"), json={"model": BASE, **body})
    assert_client_error(response, 400, f"context length {CONTEXT}")
    assert response.json()["error"]["type"] in ("invalid_request_error", "BadRequestError")
    still_serves(http, url_of(servers, where, "/v1/chat/completions"))


def test_a_stop_string_the_engine_refuses_is_a_client_error(servers: Servers, http: httpx.Client) -> None:
    body = {"model": BASE, "prompt": "ab", "max_tokens": 2, "stop": [""]}
    assert_client_error(http.post(f"{servers.gateway}/v1/completions", json=body), 422, "stop", param="stop")


def test_a_model_name_too_long_to_be_a_run_is_422(servers: Servers, http: httpx.Client) -> None:
    body = {"model": "run@v" + "9" * 5000, "prompt": "ab", "max_tokens": 2}
    assert_client_error(http.post(f"{servers.gateway}/v1/completions", json=body), 422, "model", param="model")


def test_a_seed_torch_cannot_take_is_400(servers: Servers, http: httpx.Client) -> None:
    body = {"model": BASE, "messages": CHAT, "max_tokens": 2, "seed": 2**70}
    assert_client_error(http.post(f"{servers.engine}/v1/chat/completions", json=body), 400, "seed")
    native = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "sampling_seed": -(2**70)}}
    assert_client_error(http.post(f"{servers.engine}/generate", json=native), 400, "seed")


# top logprobs ------------------------------------------------------------------------------------
def check_alternatives(entries: list[dict[str, Any]], k: int) -> None:
    """Chat logprobs: k alternatives per token, best first; greedy picks the best one."""
    assert entries
    for entry in entries:
        top = entry["top_logprobs"]
        assert len(top) == k and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True)
        assert entry["logprob"] == pytest.approx(values[0], abs=1e-5)


@pytest.mark.parametrize("where", ["gateway", "engine"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_chat_top_logprobs_are_listed(servers: Servers, http: httpx.Client, where: str, k: int) -> None:
    body = {"model": BASE, "messages": CHAT, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": k}
    response = http.post(url_of(servers, where, "/v1/chat/completions"), json=body)
    assert response.status_code == 200, response.text
    check_alternatives(response.json()["choices"][0]["logprobs"]["content"], k)

    with http.stream("POST", url_of(servers, where, "/v1/chat/completions"), json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [e for c in events for ch in c.get("choices", []) for e in ((ch.get("logprobs") or {}).get("content") or [])]
    check_alternatives(streamed, k)
    assert len(streamed) == len(response.json()["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("where", ["gateway", "engine"])
@pytest.mark.parametrize("k", [1, 5])
def test_completion_logprobs_count_lists_alternatives(servers: Servers, http: httpx.Client, where: str, k: int) -> None:
    body = {"model": BASE, "prompt": "Count:", "max_tokens": 4, "temperature": 0, "logprobs": k}
    response = http.post(url_of(servers, where, "/v1/completions"), json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["top_logprobs"]) == len(logprobs["tokens"]) == 4
    for chosen, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert 1 <= len(top) <= k  # alternatives that decode to the same text share a key
        assert max(top.values()) == pytest.approx(lp, abs=1e-5) and chosen in top


@pytest.mark.parametrize("where", ["gateway", "engine"])
@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "logprobs"),  # alternatives without logprobs
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ],
)
def test_out_of_range_top_logprobs_are_refused(
    servers: Servers, http: httpx.Client, where: str, path: str, extra: dict[str, Any], field: str
) -> None:
    body = {"model": BASE, "max_tokens": 2, **extra}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "Count:"})
    assert_client_error(http.post(url_of(servers, where, path), json=body), 422, field)


def test_native_generate_returns_top_logprobs_in_sglang_shape(servers: Servers, http: httpx.Client) -> None:
    body = {"text": "Count:", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 4}
    meta = http.post(f"{servers.engine}/generate", json=body).json()["meta_info"]
    assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"]) == 3
    for (lp, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert len(top) == 4 and all(len(t) == 3 and t[2] is None for t in top)
        assert top[0][1] == token and top[0][0] == pytest.approx(lp, abs=1e-5)
    refused = http.post(f"{servers.engine}/generate", json={**body, "top_logprobs_num": 21})
    assert_client_error(refused, 422, "top_logprobs_num")
