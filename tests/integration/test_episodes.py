"""Multi-turn episodes and tool calls through the gateway, on loopback with a real Redis.

The tiny model's transformers engine serves the turns where what matters is the ids a real
engine samples: they reach the episode unchanged, turn after turn, while a re-render of the
conversation would give other ids. A scripted engine (a small HTTP server answering /generate
with set texts, as SGLang would) serves the tool-call turns, which a random model never writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from helpers.loopback import serve_app
from helpers.servers import BASE, gateway, inference_settings
from helpers.waiting import wait_until

from tandem import keys
from tandem.settings import EngineSettings
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_inference.errors import EpisodeConflict
from tandem_inference.gateway.episodes import Episode, EpisodeStore

pytestmark = pytest.mark.integration

LIMIT = 24
START = [{"role": "system", "content": "You count."}, {"role": "user", "content": "Count to 3."}]
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    settings = EngineSettings(model=str(tiny_model), device="cpu", served_model_name=BASE, max_new_tokens_limit=LIMIT)
    with serve_app(create_engine_app(settings)) as url:
        yield url


@contextmanager
def served(engine: str, redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any,
           **gateway_settings: Any) -> Iterator[str]:
    settings = inference_settings(redis_url, tmp_path / "store", engine, tiny_model, limit=LIMIT, **gateway_settings)
    with gateway(settings, tokenizer, with_controller=False) as url:
        yield url


@pytest.fixture
def url(engine_url: str, redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any,
        redis_conn: redis.Redis) -> Iterator[str]:
    with served(engine_url, redis_url, tmp_path, tiny_model, tokenizer) as u:
        yield u


def turn(url: str, episode: str, messages: list[Any], **extra: Any) -> httpx.Response:
    body = {"model": BASE, "messages": messages, "episode": episode, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def said(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# token faithfulness -----------------------------------------------------------------------------
def test_three_turns_keep_every_sampled_id_and_add_only_the_template_tokens_of_new_messages(
        url: str, tokenizer: Any) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    new_messages = [[], [{"role": "tool", "content": "1 2"}], [{"role": "user", "content": "Now to 5."}]]
    expected_new = ["", "<|im_start|>user\n<tool_response>\n1 2\n</tool_response><|im_end|>\n",
                    "<|im_start|>user\nNow to 5.<|im_end|>\n"]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        messages: list[Any] = list(START)
        expected: list[int] = []
        sampled_spans = []
        for k in range(3):
            messages += new_messages[k]
            resp = client.chat.completions.create(model=BASE, messages=messages, max_tokens=[8, 12, 10][k],
                                                  extra_body={"episode": "ep-faithful"})
            extra = resp.model_extra or {}
            sampled = extra["tandem"]["completion_token_ids"][0]
            if k == 0:
                expected = encode(tokenizer, tokenizer.apply_chat_template(START, tokenize=False,
                                                                           add_generation_prompt=True))
                assert extra["tandem"]["episode"]["prompt_ids"] == expected
            else:  # independently: the closing of the last turn, the new message, the generation prompt
                closing = "\n" if expected[-1] == end else "<|im_end|>\n"
                expected += encode(tokenizer, closing + expected_new[k] + "<|im_start|>assistant\n")
            assert extra["tandem"]["prompt_token_ids"] == expected  # what the engine sampled from
            sampled_spans.append((len(expected), sampled, extra["tandem"]["completion_logprobs"][0]))
            expected = expected + sampled
            messages.append(resp.choices[0].message)  # the agent echoes the reply object as it came
        episode = extra["tandem"]["episode"]
    assert episode == httpx.get(f"{url}/v1/episodes/ep-faithful").json()
    assert episode["turns"] == 3 and episode["versions"] == [0, 0, 0]
    assert episode["runs"] == episode["adapters"] == [None] * 3  # the base model by its own name: no run
    prompt = episode["prompt_ids"]
    assert prompt + episode["completion_ids"] == expected
    mask = [0] * len(episode["completion_ids"])
    for start, ids, logprobs in sampled_spans:  # the engine's ids unchanged, at their place
        at = start - len(prompt)
        assert episode["completion_ids"][at:at + len(ids)] == ids
        assert episode["rollout_logprobs"][at:at + len(ids)] == logprobs
        mask[at:at + len(ids)] = [1] * len(ids)
    assert episode["loss_mask"] == mask
    assert all(lp == 0.0 for lp, m in zip(episode["rollout_logprobs"], mask, strict=True) if m == 0)


def test_a_naive_rerender_of_the_conversation_gives_other_ids_than_the_episode(url: str, tokenizer: Any) -> None:
    """Random tiny-model text seldom tokenizes back into the ids that wrote it: the episode keeps
    the sampled ids where the template applied to the whole conversation would not."""
    differs = []
    for attempt in range(5):
        messages: list[dict[str, Any]] = list(START)
        episode = f"ep-naive-{attempt}"
        reply = said(turn(url, episode, messages, max_tokens=16))
        messages += [reply["choices"][0]["message"], {"role": "user", "content": "Again."}]
        second = said(turn(url, episode, messages, max_tokens=4))
        held = second["tandem"]["prompt_token_ids"]
        assert held[:len(reply["tandem"]["prompt_token_ids"])] == reply["tandem"]["prompt_token_ids"]
        assert reply["tandem"]["completion_token_ids"][0] == \
            held[len(reply["tandem"]["prompt_token_ids"]):][:len(reply["tandem"]["completion_token_ids"][0])]
        naive = encode(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        differs.append(naive != held)
        if naive != held:
            break
    assert any(differs), "every re-render matched the sampled ids; the episode would add nothing"


# refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("extra", "param"), [
    ({"episode": "bad id!"}, "episode"), ({"episode": "x" * 129}, "episode"),
    ({"episode": "ep", "n": 2}, "n"), ({"episode": "ep", "stream": True}, "stream"),
])
def test_bad_ids_n_and_stream_are_422_naming_the_field(url: str, extra: dict[str, Any], param: str) -> None:
    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": BASE, "messages": START, **extra}, timeout=30)
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert httpx.get(f"{url}/v1/episodes/ep").status_code == 404  # nothing was stored


@pytest.mark.parametrize(("route", "body", "param"), [
    ("chat/completions", {"messages": START, "episode_id": "ep"}, "episode_id"),  # the client's name of the field
    ("completions", {"prompt": "hi", "episode": "ep"}, "episode"),  # episodes are chat's
    ("completions", {"prompt": "hi", "episode_id": "ep"}, "episode_id"),
])
def test_an_episode_asked_where_none_is_kept_is_refused_not_served_without_it(
        url: str, route: str, body: dict[str, Any], param: str) -> None:
    """Ignored like other unknown fields, these served the turn and kept no episode: its
    trajectory was lost, found out only when reading the episode back."""
    resp = httpx.post(f"{url}/v1/{route}", json={"model": BASE, "max_tokens": 2, **body}, timeout=30)
    assert resp.status_code == 422 and resp.json()["error"]["param"] == param, resp.text
    assert "`episode`" in resp.json()["error"]["message"] or "/v1/chat/completions" in resp.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/episodes/ep").status_code == 404


def test_a_continuation_that_is_not_a_prefix_is_409_naming_the_first_differing_message(url: str) -> None:
    first = said(turn(url, "ep-x", START, max_tokens=4))
    reply = first["choices"][0]["message"]
    changed = {"role": "assistant", "content": reply["content"] + " (edited)"}
    resp = turn(url, "ep-x", [*START, changed, {"role": "user", "content": "go"}], max_tokens=4)
    assert resp.status_code == 409 and resp.json()["error"]["param"] == "messages"
    assert "messages[2]" in resp.json()["error"]["message"]
    resp = turn(url, "ep-x", [START[0], {"role": "user", "content": "other"}, reply], max_tokens=4)
    assert resp.status_code == 409 and "messages[1]" in resp.json()["error"]["message"]
    resp = turn(url, "ep-x", [*START, reply, {"role": "assistant", "content": "made up"}], max_tokens=4)
    assert resp.status_code == 422 and "messages[3]" in resp.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/episodes/ep-x").json() == first["tandem"]["episode"]  # unchanged
    said(turn(url, "ep-x", [*START, reply, {"role": "user", "content": "go"}], max_tokens=4))


@pytest.mark.parametrize(("first", "later", "refused"), [
    ({"temperature": 1.0}, {"temperature": 0.7}, True), ({}, {"temperature": 0.5}, True),
    ({"temperature": 0.7}, {"temperature": 0.7}, False), ({"temperature": 0}, {}, False),  # greedy counts as 1
])
def test_a_turn_at_another_temperature_is_409_naming_it_before_anything_is_sampled(
        url: str, first: dict[str, Any], later: dict[str, Any], refused: bool) -> None:
    """One trajectory trains under one temperature: a turn that changes it would make the whole
    episode untrainable, so it is refused at that turn, not found out at training."""
    episode = f"ep-t-{len(first)}-{first.get('temperature')}-{later.get('temperature')}"
    reply = said(turn(url, episode, START, max_tokens=3, **first))["choices"][0]["message"]
    resp = turn(url, episode, [*START, reply, {"role": "user", "content": "go"}], max_tokens=3, **later)
    if refused:
        assert resp.status_code == 409 and resp.json()["error"]["param"] == "temperature", resp.text
        assert "sample every turn of an episode at the same temperature" in resp.text
        assert httpx.get(f"{url}/v1/episodes/{episode}").json()["turns"] == 1
    else:
        assert said(resp)["tandem"]["episode"]["turns"] == 2


def test_an_unknown_episode_with_assistant_turns_is_404_and_get_delete(url: str) -> None:
    resp = turn(url, "ep-new", [*START, {"role": "assistant", "content": "1"}, {"role": "user", "content": "go"}])
    assert resp.status_code == 404 and "ep-new" in resp.json()["error"]["message"]
    assert "gateway.episode_ttl_s" in resp.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/episodes/ep-new").status_code == 404
    said(turn(url, "ep-new", START, max_tokens=2))
    assert httpx.get(f"{url}/v1/episodes/ep-new").json()["turns"] == 1
    assert 'tandem_gateway_episode_turns_total{kind="start"} 1.0' in httpx.get(f"{url}/metrics").text
    assert httpx.delete(f"{url}/v1/episodes/ep-new").status_code == 204
    assert httpx.delete(f"{url}/v1/episodes/ep-new").status_code == 204  # idempotent
    assert httpx.get(f"{url}/v1/episodes/ep-new").status_code == 404
    assert httpx.get(f"{url}/v1/episodes/bad%20id").status_code == 422


def test_a_turn_past_the_token_bound_is_400_and_the_episode_stays(
        engine_url: str, redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any,
        redis_conn: redis.Redis) -> None:
    with served(engine_url, redis_url, tmp_path, tiny_model, tokenizer, episode_max_tokens=48) as url:
        first = said(turn(url, "ep-long", START, max_tokens=4))
        held = first["tandem"]["episode"]
        messages = [*START, first["choices"][0]["message"], {"role": "user", "content": "more"}]
        resp = turn(url, "ep-long", messages, max_tokens=LIMIT)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "max_tokens" and "episode_max_tokens = 48" in resp.text
        assert httpx.get(f"{url}/v1/episodes/ep-long").json() == held
        flood = [*messages[:-1], {"role": "tool", "content": "word " * 200}]  # a tool result past the bound alone
        resp = turn(url, "ep-long", flood, max_tokens=1)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text
        assert "shorten them (a long tool result)" in resp.text and "episode_max_tokens = 48" in resp.text
        assert httpx.get(f"{url}/v1/episodes/ep-long").json() == held
        too_long = said(turn(url, "ep-long", messages, max_tokens=1))["tandem"]["episode"]  # within the bound
        assert len(too_long["prompt_ids"]) + len(too_long["completion_ids"]) <= 48


def test_the_default_bound_is_the_engines_context_length(url: str) -> None:
    long = [{"role": "user", "content": "7 " * 1100}]  # past the tiny model's 1024 positions
    resp = turn(url, "ep-huge", long, max_tokens=2)
    assert resp.status_code == 400 and "episode_max_tokens = 1024" in resp.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/episodes/ep-huge").status_code == 404


def test_a_colliding_episode_id_reads_nothing_of_the_other_conversation(
        engine_url: str, redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any) -> None:
    secret = "my account number is 4711-0815"
    with served(engine_url, redis_url, tmp_path, tiny_model, tokenizer) as url:
        said(turn(url, "ep-shared-id", [{"role": "user", "content": secret}], max_tokens=2))
        other = turn(url, "ep-shared-id", [{"role": "user", "content": "hello"}], max_tokens=2)
        assert other.status_code == 409 and "messages[0] differs" in other.text
        assert "4711" not in other.text and secret not in other.text


def test_an_expired_episode_is_404_on_its_continuation(
        engine_url: str, redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any,
        redis_conn: redis.Redis) -> None:
    with served(engine_url, redis_url, tmp_path, tiny_model, tokenizer, episode_ttl_s=0.5) as url:
        first = said(turn(url, "ep-ttl", START, max_tokens=2))
        assert 0 < redis_conn.pttl(keys.episode("ep-ttl")) <= 500
        wait_until(lambda: httpx.get(f"{url}/v1/episodes/ep-ttl").status_code == 404, 10, "the episode to expire")
        resp = turn(url, "ep-ttl", [*START, first["choices"][0]["message"], {"role": "user", "content": "go"}])
        assert resp.status_code == 404
        assert "expired (gateway.episode_ttl_s = 0.5 s)" in resp.json()["error"]["message"]


def test_the_store_saves_a_turn_only_over_the_episode_it_began_from(redis_conn: redis.Redis, redis_url: str) -> None:
    store = EpisodeStore(redis.Redis.from_url(redis_url), ttl_s=60)
    episode = Episode(id="ep-race", run=BASE, tools=None, messages=["{}"], prompt_ids=[1, 2])
    one = episode.model_copy(update={"completion_ids": [3], "loss_mask": [1], "rollout_logprobs": [-1.0],
                                     "versions": [0]})
    store.save(one, after_turns=0)
    with pytest.raises(EpisodeConflict, match="another request advanced episode 'ep-race'"):
        store.save(one, after_turns=0)  # a second first turn under the same id
    assert store.get("ep-race") == one
    redis_conn.set(keys.episode("ep-bad"), "not json")
    with pytest.raises(EpisodeConflict, match="does not parse"):
        store.get("ep-bad")


# tool calls (a scripted engine) -----------------------------------------------------------------
@contextmanager
def scripted_engine(tokenizer: Any, replies: list[str]) -> Iterator[tuple[str, list[list[int]]]]:
    """An engine answering /generate with `replies` in turn (ended by <|im_end|>); yields its URL
    and the input ids it was sent."""
    app, seen = FastAPI(), []
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    @app.post("/generate", response_model=None)
    async def generate(request: Request) -> dict[str, Any] | StreamingResponse:
        body = await request.json()
        seen.append(body["input_ids"])
        text = replies[len(seen) - 1]
        ids = [*encode(tokenizer, text), end]
        if body.get("stream"):  # SGLang's cumulative chunks, a token at a time
            def chunks() -> Iterator[str]:
                for k in range(1, len(ids) + 1):
                    meta: dict[str, Any] = {"completion_tokens": k,
                                            "output_token_logprobs": [[-0.25, i, None] for i in ids[:k]]}
                    if k == len(ids):
                        meta["finish_reason"] = {"type": "stop", "matched": end}
                    piece = tokenizer.decode(ids[:k], skip_special_tokens=True)
                    yield "data: " + json.dumps({"text": piece, "output_ids": ids[:k], "meta_info": meta}) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")
        return {"text": text, "output_ids": ids,
                "meta_info": {"finish_reason": {"type": "stop", "matched": end}, "completion_tokens": len(ids),
                              "output_token_logprobs": [[-0.25, i, None] for i in ids]}}

    @app.get("/server_info")
    async def info() -> dict[str, Any]:
        return {"context_length": 4096}

    with serve_app(app) as url:
        yield url, seen


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def test_tool_calls_come_back_in_openais_shape_and_the_episode_goes_on_after_them(
        redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any, redis_conn: redis.Redis) -> None:
    replies = ["Let me add.\n" + CALL, "It is 5."]
    with scripted_engine(tokenizer, replies) as (engine, seen), \
            served(engine, redis_url, tmp_path, tiny_model, tokenizer) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        messages: list[Any] = list(START)
        first = client.chat.completions.create(model=BASE, messages=messages, tools=[ADD],  # type: ignore[list-item]
                                               extra_body={"episode": "ep-tool"})
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
        [call] = choice.message.tool_calls or []
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        prompt = tokenizer.apply_chat_template(START, tools=[ADD], tokenize=False, add_generation_prompt=True)
        assert seen[0] == encode(tokenizer, prompt) and "<tools>" in prompt
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = client.chat.completions.create(model=BASE, messages=messages, tools=[ADD],  # type: ignore[list-item]
                                                extra_body={"episode": "ep-tool"})
        assert second.choices[0].message.content == "It is 5." and not second.choices[0].message.tool_calls
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampled = [*encode(tokenizer, replies[0]), end]
    delta = encode(tokenizer, "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert seen[1] == seen[0] + sampled + delta  # the call's ids as sampled, not re-rendered from tool_calls
    episode = (second.model_extra or {})["tandem"]["episode"]
    assert episode["prompt_ids"] + episode["completion_ids"] == seen[1] + [*encode(tokenizer, replies[1]), end]


def test_streamed_tool_calls_come_in_openais_delta_shape(
        redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any, redis_conn: redis.Redis) -> None:
    """Agent frameworks stream: the openai package's raw stream and its stream() helper both see
    the call as `tool_calls` (arguments in pieces) with finish_reason tool_calls, the text before
    it as content, and no `<tool_call>` text."""
    two = CALL + "\n" + CALL.replace('"a": 2, "b": 3', '"a": 4, "b": 1')
    replies = ["Let me add.\n" + CALL, "Let me add.\n" + CALL, two, "No tools needed: 5 < 6."]
    with scripted_engine(tokenizer, replies) as (engine, _), \
            served(engine, redis_url, tmp_path, tiny_model, tokenizer) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        chunks = list(client.chat.completions.create(model=BASE, messages=START, tools=[ADD],  # type: ignore[list-item]
                                                     stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert content == "Let me add.\n" and "<tool_call>" not in content and finish == ["tool_calls"]
        assert pieces[0].id and pieces[0].function.name == "add" and len(pieces) > 2  # arguments in pieces
        assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"a": 2, "b": 3}

        with client.chat.completions.stream(model=BASE, messages=START, tools=[ADD]) as stream:  # type: ignore[list-item]
            final = stream.get_final_completion()
        [call] = final.choices[0].message.tool_calls or []
        assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3}

        chunks = list(client.chat.completions.create(model=BASE, messages=START, tools=[ADD], stream=True))  # type: ignore[list-item]
        by_index: dict[int, str] = {}
        for c in chunks:
            for t in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                by_index[t.index] = by_index.get(t.index, "") + (t.function.arguments or "")
        assert [json.loads(by_index[i]) for i in sorted(by_index)] == [{"a": 2, "b": 3}, {"a": 4, "b": 1}]

        plain = list(client.chat.completions.create(model=BASE, messages=START, tools=[ADD], stream=True))  # type: ignore[list-item]
        assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == replies[3]
        assert [c.choices[0].finish_reason for c in plain if c.choices and c.choices[0].finish_reason] == ["stop"]


@pytest.mark.clients
def test_langchain_bind_tools_stream_gets_the_call(
        redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any, redis_conn: redis.Redis) -> None:
    """LangChain's ChatOpenAI streams by default in agents: `bind_tools(...).stream()` chunks add up
    to a message with the call in `tool_calls` (make test-clients installs langchain-openai)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    with scripted_engine(tokenizer, ["Let me add.\n" + CALL, "Let me add.\n" + CALL]) as (engine, _), \
            served(engine, redis_url, tmp_path, tiny_model, tokenizer) as url:
        chat = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=BASE, max_retries=0)
        chunks = list(chat.bind_tools([ADD]).stream(START))
        message = chunks[0]
        for chunk in chunks[1:]:
            message = message + chunk
        assert message.content == "Let me add.\n" and "<tool_call>" not in str(message.content)
        [call] = message.tool_calls
        assert call["name"] == "add" and call["args"] == {"a": 2, "b": 3}
        assert message.response_metadata.get("finish_reason") == "tool_calls"
        whole = chat.bind_tools([ADD]).invoke(START)  # not streamed: the same call
        assert [c["args"] for c in whole.tool_calls] == [{"a": 2, "b": 3}]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 2\n</tool_call>',
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "add"',
])
def test_malformed_tool_calls_are_a_plain_text_answer(
        redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any, redis_conn: redis.Redis, text: str) -> None:
    with scripted_engine(tokenizer, [text]) as (engine, _), \
            served(engine, redis_url, tmp_path, tiny_model, tokenizer) as url:
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                          json={"model": BASE, "messages": START, "tools": [ADD], "episode": "ep-bad-call"})
        choice = said(resp)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"


def test_several_calls_in_one_reply(redis_url: str, tmp_path: Path, tiny_model: Path, tokenizer: Any,
                                    redis_conn: redis.Redis) -> None:
    two = CALL + "\n" + CALL.replace('"a": 2', '"a": 7')
    with scripted_engine(tokenizer, [two]) as (engine, _), \
            served(engine, redis_url, tmp_path, tiny_model, tokenizer) as url:
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                          json={"model": BASE, "messages": START, "tools": [ADD], "tool_choice": "auto"})
        message = said(resp)["choices"][0]["message"]
    assert message["content"] is None
    assert [json.loads(c["function"]["arguments"])["a"] for c in message["tool_calls"]] == [2, 7]
