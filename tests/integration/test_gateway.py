"""The gateway served on loopback with its controller, the real engine, redis and real adapters
(the `engine_url`, `settings` and `url` fixtures of conftest.py).

Clients are the `openai` package (what users point at tandem) and plain httpx for the
error shapes. Versions are published the way the trainer does it (tests/helpers/adapters.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from helpers.adapters import announce, publish
from helpers.loopback import free_port, held_stream_proxy, serve_app
from helpers.servers import BASE, gateway, inference_settings
from helpers.waiting import wait_until

from tandem import Client, EpisodeState, Origin
from tandem.acl import Role
from tandem.adapters import AdapterStore
from tandem.errors import GatewayError
from tandem.events import EventStream
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.settings import InferenceSettings

pytestmark = pytest.mark.integration

LIMIT = 64  # the max_tokens limit of conftest's `settings` (helpers.servers.inference_settings' default)
CHAT = [{"role": "system", "content": "You count."}, {"role": "user", "content": "What is 2 plus 2?"}]


def train(
    settings: InferenceSettings, conn: redis.Redis, tiny_model: Path, url: str, run: str, version: int
) -> None:
    """Publish a version like the trainer and wait until the gateway routes the run to it."""
    store = AdapterStore(settings.store.root)
    announce(EventStream(conn), store, publish(store, Registry(conn), tiny_model, run, version))
    wait_until(
        lambda: httpx.get(f"{url}/v1/runs/{run}").json()["serving_version"] == version,
        what=f"{run} v{version} serving",
    )


@contextmanager
def oai(url: str, api_key: str = "unused") -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0) as client:
        yield client


@pytest.fixture
def client(url: str) -> Iterator[openai.OpenAI]:
    with oai(url) as c:
        yield c


# tests ------------------------------------------------------------------------------------------
def test_chat_reports_the_version_and_switches_after_a_load(
    url: str,
    client: openai.OpenAI,
    run: str,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    tiny_model: Path,
    tokenizer: Any,
) -> None:
    raw = client.chat.completions.with_raw_response.create(model=run, messages=CHAT, max_tokens=6)
    resp = raw.parse()
    assert raw.headers["x-tandem-run"] == run and raw.headers["x-tandem-version"] == "0"
    ext = resp.model_extra["tandem"]
    assert ext["run"] == run and ext["version"] == 0 and ext["adapter"] is None
    assert resp.model == f"{run}@v0" and resp.object == "chat.completion"
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None  # not asked for
    expected_prompt = tokenizer(
        tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    assert ext["prompt_token_ids"] == expected_prompt
    assert resp.usage.prompt_tokens == len(expected_prompt)
    assert (
        resp.usage.completion_tokens
        == len(ext["completion_token_ids"][0])
        == len(ext["completion_logprobs"][0])
    )

    train(settings, redis_conn, tiny_model, url, run, 1)
    raw = client.chat.completions.with_raw_response.create(model=run, messages=CHAT, max_tokens=6)
    ext = raw.parse().model_extra["tandem"]
    assert raw.headers["x-tandem-version"] == "1"
    assert ext["version"] == 1 and ext["adapter"] == f"{run}-v1"


def test_an_episode_names_the_run_and_adapter_of_each_turn_for_its_trajectory(
        url: str, client: openai.OpenAI, run: str, settings: InferenceSettings, redis_conn: redis.Redis,
        tiny_model: Path) -> None:
    """What an agent on the openai package builds its trajectory from (docs/agents.md): the episode
    says which run and adapter served each turn, and the trajectory carries its oldest turn's."""
    messages: list[Any] = list(CHAT)
    first = client.chat.completions.create(model=run, messages=messages, max_tokens=4,
                                           extra_body={"episode": "ep-origin"})
    messages += [first.choices[0].message, {"role": "user", "content": "And 3 plus 3?"}]
    train(settings, redis_conn, tiny_model, url, run, 1)
    second = client.chat.completions.create(model=run, messages=messages, max_tokens=4,
                                            extra_body={"episode": "ep-origin"})
    ext = (second.model_extra or {})["tandem"]
    assert (ext["run"], ext["version"], ext["adapter"]) == (run, 1, f"{run}-v1")
    episode = ext["episode"]
    assert episode["versions"] == [0, 1] and episode["runs"] == [run, run]
    assert episode["adapters"] == [None, f"{run}-v1"]
    trajectory = EpisodeState.model_validate(httpx.get(f"{url}/v1/episodes/ep-origin").json()).to_trajectory(1.0)
    assert (trajectory.version, trajectory.origin) == (0, Origin(run=run))


def test_token_ids_and_logprobs_match_a_direct_generate_call(
    url: str,
    client: openai.OpenAI,
    run: str,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    tiny_model: Path,
    engine_url: str,
    tokenizer: Any,
) -> None:
    train(settings, redis_conn, tiny_model, url, run, 1)
    resp = client.chat.completions.create(
        model=run, messages=CHAT, max_tokens=10, temperature=0, logprobs=True
    )
    ext = resp.model_extra["tandem"]
    direct = httpx.post(
        f"{engine_url}/generate",
        json={
            "input_ids": ext["prompt_token_ids"],
            "lora_path": f"{run}-v1",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0},
        },
    ).json()
    triples = direct["meta_info"]["output_token_logprobs"]
    assert ext["completion_token_ids"][0] == [t[1] for t in triples] == direct["output_ids"]
    assert ext["completion_logprobs"][0] == pytest.approx([t[0] for t in triples], abs=1e-5)
    assert resp.choices[0].message.content == direct["text"]
    assert [c.logprob for c in resp.choices[0].logprobs.content] == ext["completion_logprobs"][0]
    assert "".join(c.token for c in resp.choices[0].logprobs.content) == tokenizer.decode(
        ext["completion_token_ids"][0]
    )


def test_completions_with_text_or_token_ids_and_n(
    url: str, client: openai.OpenAI, run: str, tokenizer: Any
) -> None:
    resp = client.completions.create(model=run, prompt="Count: 1 2 3", max_tokens=5, n=3, logprobs=1)
    ext = resp.model_extra["tandem"]
    assert resp.object == "text_completion" and len(resp.choices) == 3
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert ext["prompt_token_ids"] == tokenizer("Count: 1 2 3")["input_ids"]
    assert len(ext["completion_token_ids"]) == len(ext["completion_logprobs"]) == 3
    for choice, ids, lps in zip(resp.choices, ext["completion_token_ids"], ext["completion_logprobs"], strict=True):
        assert choice.logprobs.token_logprobs == lps and len(ids) == len(lps) <= 5
    assert resp.usage.completion_tokens == sum(len(ids) for ids in ext["completion_token_ids"])

    by_ids = client.completions.create(
        model="base", prompt=ext["prompt_token_ids"], max_tokens=4, temperature=0
    )
    assert by_ids.model_extra["tandem"]["prompt_token_ids"] == ext["prompt_token_ids"]
    assert by_ids.model_extra["tandem"]["run"] is None and by_ids.model == "base"


def test_streaming_chat_and_completions(
    url: str,
    client: openai.OpenAI,
    run: str,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    tiny_model: Path,
) -> None:
    train(settings, redis_conn, tiny_model, url, run, 1)
    plain = client.chat.completions.create(model=run, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(model=run, messages=CHAT, max_tokens=12, temperature=0, stream=True)
    )
    assert all(
        c.model_extra["tandem"]["run"] == run and c.model_extra["tandem"]["version"] == 1 for c in chunks
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    # OpenAI's shape: every chunk has a choice unless the usage is asked for; the finish carries the extension
    assert all(c.choices for c in chunks) and chunks[-1].usage is None
    assert chunks[-1].model_extra["tandem"]["completion_token_ids"] == plain.model_extra["tandem"]["completion_token_ids"]
    chunks = list(client.chat.completions.create(model=run, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert [c.usage is not None for c in chunks].count(True) == 1  # only the last
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == plain.usage.completion_tokens
    assert (
        last.model_extra["tandem"]["completion_token_ids"]
        == plain.model_extra["tandem"]["completion_token_ids"]
    )
    assert last.model_extra["tandem"]["completion_logprobs"][0] == pytest.approx(
        plain.model_extra["tandem"]["completion_logprobs"][0], abs=1e-5
    )

    stream = list(
        client.completions.create(model=f"{run}@v1", prompt="Count:", max_tokens=6, n=2, stream=True,
                                  stream_options={"include_usage": True})
    )
    texts = {0: "", 1: ""}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
    ext = stream[-1].model_extra["tandem"]
    assert len(ext["completion_token_ids"]) == 2 and ext["version"] == 1
    assert stream[-1].usage.completion_tokens == sum(len(ids) for ids in ext["completion_token_ids"])
    assert all(len(ids) <= 6 for ids in ext["completion_token_ids"])
    assert all(isinstance(t, str) for t in texts.values())


def test_a_stream_holds_its_version_in_flight_until_it_ends(
    role_urls: dict[Role, str], tmp_path: Path, engine_url: str, tiny_model: Path, tokenizer: Any, run: str
) -> None:
    with held_stream_proxy(engine_url) as (proxied, release):
        settings = inference_settings(role_urls[Role.INFERENCE], tmp_path / "store", proxied, tiny_model, limit=LIMIT)
        with gateway(settings, tokenizer) as url:
            body = {"model": run, "prompt": "Count:", "max_tokens": LIMIT, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200 and resp.headers["x-tandem-version"] == "0"
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
                # the engine's stream is held after its first chunk: this one cannot have ended
                assert httpx.get(f"{url}/v1/runs/{run}").json()["in_flight"]["0"] == 1
                release.set()
                rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]"
            # the server lets go in the stream's cleanup, which may run just after the client saw [DONE]
            deadline = time.monotonic() + 5
            while httpx.get(f"{url}/v1/runs/{run}").json()["in_flight"]["0"] != 0:
                assert time.monotonic() < deadline, "the finished stream still holds its version"
                time.sleep(0.02)


def test_pinned_versions_and_unknown_names(
    url: str,
    client: openai.OpenAI,
    run: str,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    tiny_model: Path,
) -> None:
    train(settings, redis_conn, tiny_model, url, run, 1)
    train(settings, redis_conn, tiny_model, url, run, 2)
    for model, version in ((f"{run}@v1", 1), (f"{run}@1", 1), (run, 2), (f"{run}@v0", 0)):
        resp = client.completions.create(model=model, prompt="Count:", max_tokens=2)
        assert resp.model_extra["tandem"]["version"] == version, model

    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model=f"{run}@v7", prompt="Count:", max_tokens=2)
    assert info.value.body["type"] == "model_not_found"
    assert info.value.body["known"] == [f"{run}@v0", f"{run}@v1", f"{run}@v2"]
    assert f"run {run!r} has no version 7: its versions are v1, v2" in info.value.body["message"]
    for bad in (f"{run}@v-1", f"{run}@v01", f"{run}@latest"):  # the version is what is wrong, not the run
        resp = httpx.post(f"{url}/v1/completions", json={"model": bad, "prompt": "Count:", "max_tokens": 2})
        assert resp.status_code == 404, bad
        assert f"is no version of run {run!r}" in resp.json()["error"]["message"], bad

    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": CHAT})
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "model_not_found" and resp.json()["error"]["known"] == [
        "base",
        run,
    ]
    assert httpx.get(f"{url}/v1/runs/nope").status_code == 404

    status = httpx.get(f"{url}/v1/runs/{run}").json()
    assert (
        status["serving_version"] == 2
        and status["loaded_versions"] == [1, 2]
        and status["latest_version"] == 2
    )
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert ids == ["base", run, f"{run}@v1", f"{run}@v2"]
    # OpenAI's models.retrieve: each listed card by its id; an unknown one a 404 listing them
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert client.models.retrieve(f"{run}@v1").id == f"{run}@v1"
    assert client.models.retrieve("base").model_extra["root"] is not None
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve(f"{run}@v9")
    assert f"{run}@v2" in str(missing.value)
    # a registered version the engine does not hold (evicted, retired, not loaded yet) is a model
    # too: a request for it loads it, so the list and models.retrieve name it as well
    publish(AdapterStore(settings.store.root), Registry(redis_conn), tiny_model, run, 3)
    assert client.models.retrieve(f"{run}@v3").id == f"{run}@v3"
    assert f"{run}@v3" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]


def test_a_run_created_after_start_is_served_by_the_base_model(
    url: str, client: openai.OpenAI, redis_conn: redis.Redis, tiny_model: Path
) -> None:
    Registry(redis_conn).create_run(RunSpec(name="late", base_model=str(tiny_model)))
    resp = client.completions.create(model="late", prompt="Count:", max_tokens=2)
    assert resp.model_extra["tandem"] == {**resp.model_extra["tandem"], "run": "late", "version": 0}


@pytest.mark.parametrize("path", ["/v1/models/late%0A", "/v1/runs/late%0A", "/v1/models/late%00", "/v1/runs/la%0Dte",
                                  "/v1/models%0A", "/health%0A"])
def test_a_name_in_the_path_with_a_control_character_is_no_name(
    url: str, redis_conn: redis.Redis, tiny_model: Path, path: str
) -> None:
    """Route patterns end in `$`, which also matches before a trailing newline: never `late`'s card."""
    Registry(redis_conn).create_run(RunSpec(name="late", base_model=str(tiny_model)))
    assert httpx.get(f"{url}/v1/runs/late").status_code == 200
    resp = httpx.get(url + path)
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["param"] == "path" and "control character" in resp.json()["error"]["message"]
    assert httpx.get(url + "/v1/models/" + "x" * 5000 + "%0A").json()["error"]["message"].count("x") < 200
    chat = httpx.post(url + "/v1/chat/completions%0A", json={"model": "base", "messages": CHAT, "max_tokens": 2})
    assert chat.status_code == 404 and chat.json()["error"]["type"] == "not_found"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "base"},  # no messages
        {"model": "base", "messages": []},
        {"model": "base", "messages": "hello"},  # wrong types
        {"model": "base", "messages": [{"role": "user"}]},
        {"model": "base", "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": "base", "messages": CHAT, "temperature": "hot"},
        {"model": "base", "messages": CHAT, "max_tokens": -1},
        {"model": "base", "messages": CHAT, "max_tokens": LIMIT + 1},  # above the limit
        {"model": "base", "messages": CHAT, "n": 0},
        {"messages": CHAT},
    ],
)
def test_malformed_chat_bodies_are_422(url: str, body: dict) -> None:
    resp = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error" and resp.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"22": -100}), ("presence_penalty", 0.5), ("frequency_penalty", -1), ("seed", 42),
    ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.05), ("parallel_tool_calls", False),
    ("tool_choice", "required"), ("modalities", ["text", "audio"]), ("functions", [{"name": "f"}]),
    ("echo", True), ("best_of", 3), ("ignore_eos", True), ("min_tokens", 50),
    ("include_stop_str_in_output", True),
])
def test_a_sampling_field_the_engines_do_not_honour_is_refused_naming_it(url: str, field: str, value: Any) -> None:
    """Never ignored: the reply would not be what was asked for."""
    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": "base", "messages": CHAT, "max_tokens": 2, field: value})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and "not supported" in error["message"], error


def test_stop_token_ids_end_a_sample_at_that_token(url: str) -> None:
    """vLLM's and SGLang's `stop_token_ids` (what Tinker's integer stops become): the sample ends at
    the first such token, which is its last, with finish_reason stop."""
    body = {"model": "base", "prompt": "Count: 1 2 3", "max_tokens": 8, "temperature": 0}
    free = httpx.post(f"{url}/v1/completions", json=body).json()
    greedy = free["tandem"]["completion_token_ids"][0]
    assert len(greedy) == 8 and free["choices"][0]["finish_reason"] == "length", free
    stop_at = next(i for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    stopped = httpx.post(f"{url}/v1/completions", json={**body, "stop_token_ids": [greedy[stop_at]]}).json()
    assert stopped["tandem"]["completion_token_ids"][0] == greedy[:stop_at + 1], (greedy, stopped)
    assert stopped["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("value", [["2"], [-1], [2.0], list(range(65)), 7])
def test_malformed_stop_token_ids_are_422_naming_the_field(url: str, value: Any) -> None:
    resp = httpx.post(f"{url}/v1/completions", json={"model": "base", "prompt": "Count:", "max_tokens": 2,
                                                      "stop_token_ids": value})
    assert resp.status_code == 422, resp.text
    assert "stop_token_ids" in resp.json()["error"]["message"] + str(resp.json()["error"].get("param"))


def test_stop_token_ids_outside_the_vocabulary_are_422_naming_them(url: str) -> None:
    """The engine refused them too, as a 400 that named no field."""
    for path, body in (("/v1/completions", {"prompt": "Count:"}), ("/v1/chat/completions", {"messages": CHAT})):
        resp = httpx.post(f"{url}{path}", json={"model": "base", "max_tokens": 2, "stop_token_ids": [3, 99999], **body})
        assert resp.status_code == 422, resp.text
        error = resp.json()["error"]
        assert error["param"] == "stop_token_ids" and "[99999] are outside the vocabulary" in error["message"], error


def test_sampling_fields_at_their_neutral_values_are_served(url: str, client: openai.OpenAI) -> None:
    """What clients send as defaults changes nothing, so it is taken."""
    neutral = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "seed": None, "top_k": -1,
               "parallel_tool_calls": True, "modalities": ["text"], "tool_choice": "auto", "user": "u",
               "metadata": {"a": "b"}, "store": False, "ignore_eos": False, "min_tokens": 0, "stop_token_ids": [],
               "echo": False, "best_of": 1}
    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": "base", "messages": CHAT, "max_tokens": 2, **neutral})
    assert resp.status_code == 200, resp.text
    for field, value in (("echo", True), ("best_of", 3), ("suffix", "!")):
        with pytest.raises(openai.UnprocessableEntityError, match=field):
            client.completions.create(model="base", prompt="Count:", max_tokens=2, **{field: value})
    assert client.completions.create(model="base", prompt="Count:", max_tokens=2, echo=False, best_of=1).choices


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Count:"}),
])
def test_stream_options_without_stream_is_refused_naming_it(url: str, route: str, body: dict[str, Any]) -> None:
    for stream in ({}, {"stream": False}):
        resp = httpx.post(f"{url}{route}", json={"model": "base", "max_tokens": 2, **body, **stream,
                                                 "stream_options": {"include_usage": True}})
        assert resp.status_code == 422, resp.text
        error = resp.json()["error"]
        assert error["param"] == "stream_options" and "stream: true" in error["message"], error
    resp = httpx.post(f"{url}{route}", json={"model": "base", "max_tokens": 2, **body, "stream_options": None})
    assert resp.status_code == 200, resp.text


#: What vLLM's and SGLang's clients send to constrain decoding, each as it would be sent.
STRUCTURED = [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}),
    ("guided_json", {"type": "object", "properties": {"value": {"type": "integer"}}}),
    ("guided_regex", "[0-9]+"), ("guided_choice", ["yes", "no"]), ("guided_grammar", 'root ::= "yes" | "no"'),
    ("structured_outputs", {"choice": ["yes", "no"]}), ("json_schema", '{"type": "object"}'), ("regex", "[0-9]+"),
    ("ebnf", 'root ::= "yes" | "no"'),
]


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Count:"}),
])
@pytest.mark.parametrize("field, value", STRUCTURED)
def test_a_structured_output_field_is_refused_naming_it_on_both_routes(
    url: str, route: str, body: dict[str, Any], field: str, value: Any
) -> None:
    """Never a 200 with unconstrained text: the engines do not constrain decoding."""
    resp = httpx.post(f"{url}{route}", json={"model": "base", "max_tokens": 2, **body, field: value})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert "not supported" in error["message"] and "constrain decoding" in error["message"], error
    assert f"leave {field} out" in error["message"], error


def test_structured_outputs_are_refused_naming_the_field_never_ignored(client: openai.OpenAI) -> None:
    import pydantic

    class Answer(pydantic.BaseModel):
        value: int

    def chat(**kw: Any) -> Callable[[], Any]:
        return lambda: client.chat.completions.create(model="base", messages=CHAT, max_tokens=4, **kw)

    def text(**kw: Any) -> Callable[[], Any]:
        return lambda: client.completions.create(model="base", prompt="Count:", max_tokens=4, **kw)

    asks = [("response_format", chat(response_format={"type": "json_object"})),
            ("response_format", lambda: client.chat.completions.parse(model="base", messages=CHAT, max_tokens=4,
                                                                      response_format=Answer)),
            ("response_format", text(extra_body={"response_format": {"type": "json_object"}}))]
    for field, value in STRUCTURED[2:]:  # vLLM's and SGLang's own, as their users send them with this client
        asks += [(field, chat(extra_body={field: value})), (field, text(extra_body={field: value}))]
    for field, ask in asks:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            ask()
        assert info.value.body["param"] == field and "not supported" in info.value.message, (field, info.value)
    plain = chat(response_format={"type": "text"}, extra_body={"guided_json": None, "regex": None})()
    assert plain.choices[0].message.role == "assistant"
    assert text(extra_body={"response_format": {"type": "text"}, "guided_choice": None})().choices


def test_a_body_above_the_limit_is_413_naming_it_declared_or_chunked(url: str) -> None:
    big = json.dumps({"model": "base", "messages": CHAT, "padding": "x" * (5 * 2**20)}).encode()
    for reply in (httpx.post(f"{url}/v1/chat/completions", content=big, headers={"content-type": "application/json"}),
                  httpx.post(f"{url}/v1/chat/completions", headers={"content-type": "application/json"},
                             content=(big[i:i + 65536] for i in range(0, len(big), 65536)))):
        assert reply.status_code == 413, reply.text
        assert "max_body_bytes" in reply.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_huge_tool_schema_is_refused_before_tokenizing_while_health_stays_fast(url: str) -> None:
    """3 MB of tool schema: far past the tiny model's context, so a 400 without tokenizing it; the
    prompt is built off the event loop, so /health answers all the while."""
    import threading

    properties = {f"field_{i}": {"type": "string", "description": "a" * 200} for i in range(14000)}
    tool = {"type": "function", "function": {"name": "huge", "parameters": {"type": "object", "properties": properties}}}
    body = {"model": "base", "messages": CHAT, "tools": [tool], "max_tokens": 4}
    assert 2.5e6 < len(json.dumps(body)) < 4 * 2**20
    replies: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: replies.append(httpx.post(f"{url}/v1/chat/completions", json=body,
                                                                        timeout=120)))
    worker.start()
    health = []
    while worker.is_alive() or not health:
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        health.append(time.monotonic() - start)
        time.sleep(0.05)
    worker.join()
    assert replies[0].status_code == 400 and "context" in replies[0].json()["error"]["message"]
    assert max(health) < 2.0, health


def test_malformed_completion_bodies_are_422(url: str, client: openai.OpenAI) -> None:
    for body in (
        {"model": "base"},
        {"model": "base", "prompt": ""},
        {"model": "base", "prompt": [1, "x"]},
        {"model": "base", "prompt": [10**9]},
        {"model": "base", "prompt": "x", "max_tokens": 10**6},
    ):
        resp = httpx.post(f"{url}/v1/completions", json=body)
        assert resp.status_code == 422, (body, resp.text)
    with pytest.raises(openai.UnprocessableEntityError, match="above the limit"):
        client.completions.create(model="base", prompt="x", max_tokens=LIMIT + 1)


def test_a_body_that_is_no_json_object_is_refused_saying_what_to_send(url: str) -> None:
    """Bodies that never reach the schema: each reply says what is wrong and what to send, names no
    field (OpenAI's `param` null), and the gateway keeps serving."""
    chat = json.dumps({"model": "base", "messages": CHAT}).encode()
    cases = [
        (b"{not json", "application/json", 422, "the body is not valid JSON: Expecting property name"),
        (chat, "text/plain", 422, "Content-Type: text/plain"),
        (chat, None, 422, "send one JSON object with Content-Type: application/json"),
        (json.dumps(json.dumps({"model": "base", "messages": CHAT})).encode(), "application/json", 422,
         "the body is JSON a string (an object encoded twice?), not an object"),
        (b"[1, 2]", "application/json", 422, "the body is JSON an array, not an object"),
        (b'{"model": "base", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "application/json", 400,
         "not UTF-8"),
        (b"[" * 50_000 + b"]" * 50_000, "application/json", 400, "nested too deeply"),
    ]
    for content, content_type, status, says in cases:
        headers = {"content-type": content_type} if content_type else {}
        resp = httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers)
        assert resp.status_code == status, (content[:40], resp.text)
        error = resp.json()["error"]
        assert says in error["message"] and error["param"] is None, error
    assert httpx.post(f"{url}/v1/chat/completions", content=chat,
                      headers={"content-type": "application/json"}).status_code == 200


def test_a_refused_value_is_named_as_the_client_sent_it(url: str) -> None:
    too_many = httpx.post(f"{url}/v1/chat/completions",
                          json={"model": "base", "messages": CHAT, "max_completion_tokens": LIMIT + 1})
    assert too_many.status_code == 422
    assert too_many.json()["error"]["param"] == "max_completion_tokens"
    assert too_many.json()["error"]["message"].startswith(f"max_completion_tokens {LIMIT + 1} is above the limit")
    outside = httpx.post(f"{url}/v1/completions", json={"model": "base", "prompt": [1, 10**9], "max_tokens": 2})
    assert outside.status_code == 422 and outside.json()["error"]["param"] == "prompt"


def test_engine_refusals_are_400_and_an_unreachable_engine_503(
    url: str, redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any
) -> None:
    too_long = {
        "model": "base",
        "prompt": [5] * 1100,
        "max_tokens": 2,
    }  # longer than the tiny model's context: the engine refuses it, for what the client asked
    resp = httpx.post(f"{url}/v1/completions", json=too_long)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert "context length 1024" in resp.json()["error"]["message"] and resp.json()["error"]["param"] == "prompt"
    for body, param in (({"prompt": [5] * 1000, "max_tokens": 60}, "max_tokens"),  # fits alone, not with the ask
                        ({"messages": [{"role": "user", "content": "x " * 1100}], "max_tokens": 2}, "messages")):
        route = "chat/completions" if "messages" in body else "completions"
        resp = httpx.post(f"{url}/v1/{route}", json={"model": "base", **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        assert "context length 1024" in resp.json()["error"]["message"]
        if param.startswith("max"):
            assert "ask for at most" in resp.json()["error"]["message"]

    dead = inference_settings(redis_url, tmp_path / "s2", f"http://127.0.0.1:{free_port()}", tiny_model)
    with gateway(dead, tokenizer, with_controller=False) as dead_url:
        resp = httpx.post(
            f"{dead_url}/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2}
        )
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "engine_unavailable"
        assert "http://" not in resp.text and "127.0.0.1" not in resp.text  # the engine's address stays inside
        assert httpx.get(f"{dead_url}/ready").status_code == 503
        assert httpx.get(f"{dead_url}/health").status_code == 200


def test_serving_the_gateway_app_starts_no_controller(
    settings: InferenceSettings, tokenizer: Any, redis_conn: redis.Redis
) -> None:
    """The inference service (tandem_inference.main) starts and stops the controller; the gateway
    app only reads it (for /ready and /metrics), so serving the app alone leaves it unstarted."""
    from tandem_inference.controller.service import Controller
    from tandem_inference.engines.transformers.client import TransformersEngine
    from tandem_inference.gateway.app import create_gateway_app
    from tandem_inference.routing import RoutingTable

    engine = TransformersEngine.from_settings(httpx.AsyncClient(), settings.engine)
    table = RoutingTable(settings.engine.served_model_name)
    controller = Controller(settings, redis_conn, engine, AdapterStore(settings.store.root), table)
    app = create_gateway_app(settings, engine=engine, table=table, tokenizer=tokenizer, registry=Registry(redis_conn),
                             controller=controller)
    with serve_app(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        assert controller.status()["reconciled"] is False and controller._task is None


def test_a_version_the_engine_lost_is_a_503_to_retry_not_a_502(
    redis_url: str, tmp_path: Path, engine_url: str, tiny_model: Path, tokenizer: Any, redis_conn: redis.Redis
) -> None:
    """A restarted engine holds no adapter until the controller loads them again: a request in
    between was a 502 "engine_error"; it is a 503 with Retry-After, which clients (the openai
    package among them) retry. (The periodic reconcile is put off here, so the window stays open.)"""
    settings = inference_settings(redis_url, tmp_path / "store", engine_url, tiny_model, limit=LIMIT)
    settings = settings.model_copy(update={"controller": settings.controller.model_copy(update={"reconcile_s": 3600})})
    Registry(redis_conn).create_run(RunSpec(name="lost", base_model=str(tiny_model)))
    with gateway(settings, tokenizer) as url:
        train(settings, redis_conn, tiny_model, url, "lost", 1)
        held = [m["id"] for m in httpx.get(f"{engine_url}/v1/models").json()["data"] if m["id"].startswith("lost-v1")]
        assert httpx.post(f"{engine_url}/unload_lora_adapter", json={"lora_name": held[0]}).status_code == 200
        resp = httpx.post(f"{url}/v1/completions", json={"model": "lost", "prompt": "x", "max_tokens": 2})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "2", resp.text
        assert resp.json()["error"]["type"] == "engine_unavailable" and "retry in 2 s" in resp.json()["error"]["message"]
        assert "http://" not in resp.text


def test_api_key_is_required_when_set(
    redis_url: str, tmp_path: Path, engine_url: str, tiny_model: Path, tokenizer: Any, redis_conn: redis.Redis
) -> None:
    settings = inference_settings(redis_url, tmp_path / "store", engine_url, tiny_model, limit=LIMIT, api_key="s3cret")
    with gateway(settings, tokenizer) as url:
        body = {"model": "base", "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        with oai(url, api_key="nope") as wrong_key, pytest.raises(openai.AuthenticationError):
            wrong_key.completions.create(model="base", prompt="x", max_tokens=2)
        with oai(url, api_key="s3cret") as right_key:
            assert right_key.completions.create(model="base", prompt="x", max_tokens=2).choices
        for auth, status in (("bearer s3cret", 200), ("BEARER s3cret", 200), ("Basic s3cret", 401),
                             ("Bearer  s3cret", 401), ("s3cret", 401)):  # the scheme is case-insensitive (RFC 7235)
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": auth}).status_code == status, auth
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/ready").status_code == 200
        for page in ("/docs", "/redoc", "/openapi.json"):  # FastAPI would serve them without the key
            assert httpx.get(f"{url}{page}").status_code == 404, page
        for key, given in ((None, "none is set"), ("nope", "a wrong one is set")):  # tandem's client and CLI
            with Client(url, redis_url, api_key=key) as client, pytest.raises(GatewayError) as refused:
                client.delete_run("nobody")
            assert refused.value.status_code == 401
            assert f"set TANDEM_API_KEY to it ({given}), or pass Client(api_key=...)" in str(refused.value)


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_api_key_is_no_key(
    empty: str, redis_url: str, tmp_path: Path, engine_url: str, tiny_model: Path, tokenizer: Any,
    redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compose passes an unset GATEWAY_API_KEY as an empty string: that is no key (requests need
    none, and the exposure check counts it as none), not a key that every client lacks."""
    monkeypatch.setenv("TANDEM_GATEWAY__API_KEY", empty)
    assert InferenceSettings().gateway.api_key is None
    settings = inference_settings(redis_url, tmp_path / "store", engine_url, tiny_model, limit=LIMIT, api_key=empty)
    assert settings.gateway.api_key is None
    with gateway(settings, tokenizer) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 200


def test_metrics_and_readiness(
    url: str,
    client: openai.OpenAI,
    run: str,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    tiny_model: Path,
) -> None:
    train(settings, redis_conn, tiny_model, url, run, 1)
    client.completions.create(model=run, prompt="x", max_tokens=2)
    httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"})
    ready = httpx.get(f"{url}/ready")
    assert ready.status_code == 200 and ready.json() == {
        "status": "ready",
        "engine": True,
        "reconciled": True,
        "in_rotation": True,
        "behind": {},
    }
    text = httpx.get(f"{url}/metrics").text
    assert f'tandem_gateway_requests_total{{model="{run}",route="/v1/completions",status="200"}} 1.0' in text
    assert 'tandem_gateway_requests_total{model="unknown",route="/v1/completions",status="404"} 1.0' in text
    assert "tandem_gateway_in_flight 0.0" in text
    assert 'tandem_gateway_request_seconds_count{route="/v1/completions"} 2.0' in text
    assert f'tandem_adapter_loads_total{{run="{run}"}} 1.0' in text
    assert json.loads(redis_conn.get(f"tandem:run:{run}:loaded")) == [1]


@pytest.mark.parametrize("names_for_all", [False, True])
def test_metrics_name_runs_only_to_a_scrape_with_the_api_key(
    names_for_all: bool, redis_url: str, tmp_path: Path, engine_url: str, tiny_model: Path, tokenizer: Any,
    redis_conn: redis.Redis, run: str,
) -> None:
    """With an API key set, /metrics without it shows each run as an opaque id (the same one for every
    label, replica and restart); with the key, or with gateway.metrics_run_names, the names."""
    from tandem_inference.gateway.metrics import opaque_run

    settings = inference_settings(redis_url, tmp_path / "store", engine_url, tiny_model, limit=LIMIT,
                                  api_key="s3cret", metrics_run_names=names_for_all)
    key = {"Authorization": "Bearer s3cret"}
    with gateway(settings, tokenizer) as url:
        store = AdapterStore(settings.store.root)
        announce(EventStream(redis_conn), store, publish(store, Registry(redis_conn), tiny_model, run, 1))
        wait_until(lambda: httpx.get(f"{url}/v1/runs/{run}", headers=key).json()["serving_version"] == 1,
                   what=f"{run} v1 serving")
        for model in (run, BASE):
            body = {"model": model, "prompt": "x", "max_tokens": 2}
            assert httpx.post(f"{url}/v1/completions", json=body, headers=key).status_code == 200
        hidden = opaque_run(run, "s3cret")
        named = httpx.get(f"{url}/metrics", headers=key).text
        assert f'tandem_serving_version{{run="{run}"}} 1.0' in named and hidden not in named
        for text in (httpx.get(f"{url}/metrics").text,
                     httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer nope"}).text):
            if names_for_all:
                assert f'tandem_serving_version{{run="{run}"}} 1.0' in text and hidden not in text
                continue
            assert run not in text
            assert f'tandem_serving_version{{run="{hidden}"}} 1.0' in text
            assert f'tandem_adapter_loads_total{{run="{hidden}"}} 1.0' in text
            assert f'tandem_gateway_requests_total{{model="{hidden}",route="/v1/completions",status="200"}} 1.0' in text
            assert f'tandem_gateway_requests_total{{model="{BASE}",route="/v1/completions",status="200"}} 1.0' in text
            assert "tandem_gateway_in_flight 0.0" in text  # the rest as it is
    assert hidden == opaque_run(run, "s3cret") != opaque_run(run, "other") and hidden.startswith("run-")


def test_a_forged_ready_for_an_unregistered_run_is_no_model(
    url: str, client: openai.OpenAI, run: str, redis_conn: redis.Redis
) -> None:
    from tandem.events import Event, EventKind

    events = EventStream(redis_conn)
    events.append(Event(kind=EventKind.ADAPTER_READY, run="ghost", version=1, data={"path": "ghost/v000001/adapter"}))
    wait_until(lambda: any(e.kind is EventKind.ADAPTER_REJECTED for e in events.history(run="ghost")),
               what="the forged event refused")
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert "ghost" not in ids and run in ids
    with pytest.raises(openai.NotFoundError, match="no run 'ghost'"):
        client.chat.completions.create(model="ghost", messages=CHAT, max_tokens=2)


@pytest.mark.parametrize("prompt", [["Hello", "World"], [[5, 6], [7, 8]], ["Hello"]])
def test_a_batch_of_prompts_is_refused_saying_to_send_one_per_request(url: str, prompt: list[Any]) -> None:
    resp = httpx.post(f"{url}/v1/completions", json={"model": "base", "prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt" and "a batch of prompts" in error["message"], error
    assert "one list of token ids" in error["message"] and "constrained-str" not in error["message"], error


def test_the_client_sends_nan_and_lone_surrogates_for_the_gateway_to_refuse_naming_the_field(
    url: str, run: str, redis_conn: redis.Redis
) -> None:
    from tandem import Client
    from tandem.errors import GatewayError

    with Client(url, conn=redis_conn) as client:
        mine = client.run(run)
        with pytest.raises(GatewayError) as nan:
            mine.chat([{"role": "user", "content": "hi"}], max_tokens=2, temperature=float("nan"))
        assert nan.value.status_code == 422 and "temperature" in str(nan.value), nan.value
        with pytest.raises(GatewayError) as lone:
            mine.chat([{"role": "user", "content": "a\ud800b"}], max_tokens=2)
        assert lone.value.status_code in (400, 422) and "surrogate" in str(lone.value), lone.value
        assert len(mine.chat([{"role": "user", "content": "hi"}], max_tokens=2)) == 1  # it serves on
