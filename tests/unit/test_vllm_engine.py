"""VLLMEngine against httpx.MockTransport answering as vLLM 0.33.0 does.

The reply bodies follow vLLM 0.33.0's source: completions and stream chunks from
vllm/entrypoints/openai/completion/protocol.py and serving.py (`completion_stream_generator`,
`request_output_to_completion_response`, `_create_completion_logprobs` with
`return_tokens_as_token_ids`), model cards from vllm/entrypoints/openai/models/serving.py and
serve/engine/protocol.py, adapter routes from vllm/entrypoints/serve/lora/api_router.py (plain
text "Success: ..." on 200), errors from serve/engine/protocol.py (`ErrorResponse`), and the
sleep routes from vllm/entrypoints/serve/dev/sleep/api_router.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tandem.settings import EngineSettings
from tandem_inference.engines.base import Sampling
from tandem_inference.engines.calls import CallKind
from tandem_inference.engines.vllm import VLLMEngine
from tandem_inference.errors import (
    AdapterLoadRefused,
    AdapterMissing,
    EngineResponseError,
    EngineTimeout,
    EngineUnreachable,
)

URL = "http://127.0.0.1:31000"


def error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> httpx.Response:
    """vLLM's ErrorResponse."""
    return httpx.Response(status, json={"error": {"message": message, "type": kind, "param": param, "code": status}})


def logprobs_of(ids: list[int], lps: list[float], tops: list[dict[int, float]] | None = None) -> dict[str, Any]:
    """CompletionLogProbs as vLLM writes it with return_tokens_as_token_ids."""
    tokens = [f"token_id:{i}" for i in ids]
    return {"text_offset": [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))],
            "token_logprobs": lps, "tokens": tokens,
            "top_logprobs": [{f"token_id:{t}": lp for t, lp in top.items()} for top in tops]
            if tops is not None else [{f"token_id:{i}": lp} for i, lp in zip(ids, lps, strict=True)]}


class FakeVLLM:
    """Answers the routes VLLMEngine calls; records what it was sent."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.adapters: dict[str, str] = {}
        self.completion: Callable[[dict[str, Any]], httpx.Response] | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        path = request.url.path + (f"?{request.url.query.decode()}" if request.url.query else "")
        self.requests.append((request.method, path, body))
        route = request.url.path
        if route == "/v1/completions":
            assert self.completion is not None
            return self.completion(body)
        if route == "/v1/load_lora_adapter":
            name = body["lora_name"]
            if name in self.adapters:
                return error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                  "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
            self.adapters[name] = body["lora_path"]
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if route == "/v1/unload_lora_adapter":
            name = body["lora_name"]
            if self.adapters.pop(name, None) is None:
                return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")
        if route == "/v1/models":
            base = {"id": "base", "object": "model", "created": 1, "owned_by": "vllm", "root": "/models/qwen",
                    "parent": None, "max_model_len": 32768, "permission": []}
            cards = [{"id": n, "object": "model", "created": 1, "owned_by": "vllm", "root": p, "parent": "base",
                      "max_model_len": None, "permission": []} for n, p in self.adapters.items()]
            return httpx.Response(200, json={"object": "list", "data": [base, *cards]})
        if route == "/health":
            return httpx.Response(200)
        if route == "/sleep":
            return httpx.Response(200, json={"status": "sleeping", "level": int(request.url.params["level"])})
        if route == "/wake_up":
            return httpx.Response(200, json={"status": "awake", "tags": request.url.params.get_list("tags") or None})
        if route in ("/pause", "/resume"):
            return httpx.Response(200, json={"status": route[1:] + "d"})
        if route == "/release_kv_cache_memory":
            return httpx.Response(200, json={"status": "kv_cache_released"})
        if route == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if route == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        if route == "/update_weight_version":
            return httpx.Response(200, json={"success": True, "new_version": body["new_version"]})
        return httpx.Response(404, json={"detail": "Not Found"})


def engine(fake: FakeVLLM, **kw: Any) -> tuple[VLLMEngine, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    return VLLMEngine(http, URL, served_model_name="base", max_lora_rank=64, **kw), http


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_complete_sends_token_ids_and_returns_every_sample_in_index_order() -> None:
    fake = FakeVLLM()

    def completion(body: dict[str, Any]) -> httpx.Response:
        choices = [  # vLLM lists choices as its outputs come; here out of order
            {"index": 1, "text": " b", "logprobs": logprobs_of([7, 8], [-0.5, -0.25]), "finish_reason": "length",
             "stop_reason": None, "token_ids": [7, 8], "prompt_logprobs": None, "prompt_token_ids": [1, 2, 3]},
            {"index": 0, "text": " a", "logprobs": logprobs_of([5], [-0.125]), "finish_reason": "stop",
             "stop_reason": None, "token_ids": [5], "prompt_logprobs": None, "prompt_token_ids": [1, 2, 3]},
        ]
        return httpx.Response(200, json={
            "id": "cmpl-1", "object": "text_completion", "created": 1, "model": body["model"], "choices": choices,
            "usage": {"prompt_tokens": 6, "total_tokens": 9, "completion_tokens": 3,
                      "prompt_tokens_details": {"cached_tokens": 2}}})

    fake.completion = completion

    async def go() -> None:
        eng, http = engine(fake)
        async with http:
            outs = await eng.complete([1, 2, 3], Sampling(max_tokens=2, temperature=0.7, stop=("\n",)), n=2,
                                      adapter="run-v3")
        assert [o.index for o in outs] == [0, 1]
        assert (outs[0].token_ids, outs[0].logprobs, outs[0].text, outs[0].finish_reason) == ([5], [-0.125], " a", "stop")
        assert (outs[1].token_ids, outs[1].logprobs, outs[1].finish_reason) == ([7, 8], [-0.5, -0.25], "length")
        assert outs[0].token_texts == [None] and outs[0].top_logprobs == [None]
        assert outs[0].cached_tokens == 2
        _, path, body = fake.requests[0]
        assert path == "/v1/completions"
        assert body == {"model": "run-v3", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.7, "top_p": 1.0,
                        "n": 2, "return_token_ids": True, "stop": ["\n"], "logprobs": 0,
                        "return_tokens_as_token_ids": True}

    run(go())


def test_the_base_model_is_asked_by_its_served_name_and_without_logprobs_ids_still_come() -> None:
    fake = FakeVLLM()
    fake.completion = lambda body: httpx.Response(200, json={
        "id": "c", "object": "text_completion", "created": 1, "model": body["model"],
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length", "token_ids": [4, 4]}],
        "usage": {"prompt_tokens": 1, "total_tokens": 3, "completion_tokens": 2}})

    async def go() -> None:
        eng, http = engine(fake)
        async with http:
            (out,) = await eng.complete([9], Sampling(max_tokens=2, ignore_eos=True), logprobs=False)
        assert (out.token_ids, out.logprobs, out.cached_tokens) == ([4, 4], [], None)
        body = fake.requests[0][2]
        assert body["model"] == "base" and body["ignore_eos"] is True
        assert "logprobs" not in body and "return_tokens_as_token_ids" not in body

    run(go())


def test_top_logprobs_are_the_k_best_by_id_without_the_extra_sampled_entry() -> None:
    fake = FakeVLLM()
    # logprobs: 2 -> vLLM lists the sampled token (here not among the best) and the 2 best
    tops = [{30: -2.0, 10: -0.1, 20: -0.9}]
    fake.completion = lambda body: httpx.Response(200, json={
        "id": "c", "object": "text_completion", "created": 1, "model": "base",
        "choices": [{"index": 0, "text": "x", "logprobs": logprobs_of([30], [-2.0], tops), "finish_reason": "length",
                     "token_ids": [30]}], "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1}})

    async def go() -> None:
        eng, http = engine(fake)
        async with http:
            (out,) = await eng.complete([1], Sampling(max_tokens=1, top_logprobs=2))
        assert out.top_logprobs == [[(-0.1, 10, None), (-0.9, 20, None)]]
        assert fake.requests[0][2]["logprobs"] == 2

    run(go())


def sse(*events: dict[str, Any]) -> httpx.Response:
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def chunk(index: int, text: str, ids: list[int], lps: list[float], finish: str | None = None) -> dict[str, Any]:
    """A CompletionStreamResponse as model_dump_json(exclude_unset=True) writes it."""
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs_of(ids, lps),
                              "finish_reason": finish, "stop_reason": None, "token_ids": ids}
    return {"id": "cmpl-s", "object": "text_completion", "created": 1, "model": "run-v3", "choices": [choice]}


def test_stream_yields_increments_per_sample_index_and_the_cached_count_last() -> None:
    fake = FakeVLLM()
    usage = {"id": "cmpl-s", "object": "text_completion", "created": 1, "model": "run-v3", "choices": [],
             "usage": {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10,
                       "prompt_tokens_details": {"cached_tokens": 3}}}
    fake.completion = lambda body: sse(
        chunk(0, "He", [11], [-0.1]), chunk(1, "Yo", [21], [-0.2]), chunk(1, "!", [22], [-0.3], "stop"),
        chunk(0, "llo", [12], [-0.4], "length"), usage)

    async def go() -> None:
        eng, http = engine(fake, api_key="k")
        async with http:
            got = [g async for g in eng.stream([1, 2], Sampling(max_tokens=2), n=2, adapter="run-v3")]
        texts = ["", ""]
        ids: list[list[int]] = [[], []]
        for g in got:
            texts[g.index] += g.text
            ids[g.index] += g.token_ids
        assert texts == ["Hello", "Yo!"] and ids == [[11, 12], [21, 22]]
        assert [(g.index, g.finish_reason) for g in got if g.finish_reason] == [(1, "stop"), (0, "length")]
        assert got[-1].cached_tokens == 3 and got[-1].token_ids == []
        _, _, body = fake.requests[0]
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}

    run(go())


def test_an_error_event_mid_stream_is_an_engine_response_error() -> None:
    fake = FakeVLLM()
    fake.completion = lambda body: sse(chunk(0, "a", [1], [-0.1]),
                                       {"error": {"message": "engine died", "type": "InternalServerError",
                                                  "param": None, "code": 500}})

    async def go() -> None:
        eng, http = engine(fake)
        async with http:
            with pytest.raises(EngineResponseError, match="engine died"):
                async for _ in eng.stream([1], Sampling(max_tokens=4)):
                    pass

    run(go())


def test_a_generation_naming_an_adapter_vllm_does_not_hold_is_adapter_missing() -> None:
    fake = FakeVLLM()
    fake.completion = lambda body: error(404, f"The model `{body['model']}` does not exist. Valid aliases: base.",
                                         "NotFoundError", "model")

    async def go() -> None:
        eng, http = engine(fake)
        async with http:
            with pytest.raises(AdapterMissing, match="run-v9"):
                await eng.complete([1], Sampling(max_tokens=1), adapter="run-v9")
            with pytest.raises(AdapterMissing):
                async for _ in eng.stream([1], Sampling(max_tokens=1), adapter="run-v9"):
                    pass

    run(go())


def test_a_bad_request_is_a_response_error_with_vllms_message() -> None:
    fake = FakeVLLM()
    fake.completion = lambda body: error(400, "This model's maximum context length is 32768 tokens.")

    async def go() -> None:
        eng, http = engine(fake)
        async with http:
            with pytest.raises(EngineResponseError) as caught:
                await eng.complete([1], Sampling(max_tokens=1), adapter="run-v1")
        assert not isinstance(caught.value, AdapterMissing)
        assert caught.value.status_code == 400 and "maximum context length" in caught.value.engine_message

    run(go())


def test_a_token_not_written_as_an_id_is_refused_clearly() -> None:
    fake = FakeVLLM()
    lp = {"text_offset": [0], "token_logprobs": [-0.1], "tokens": ["Hello"], "top_logprobs": [{"Hello": -0.1}]}
    fake.completion = lambda body: httpx.Response(200, json={
        "id": "c", "object": "text_completion", "created": 1, "model": "base",
        "choices": [{"index": 0, "text": "Hello", "logprobs": lp, "finish_reason": "length", "token_ids": [9]}],
        "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1}})

    async def go() -> None:
        eng, http = engine(fake)
        async with http:
            with pytest.raises(EngineResponseError, match="'Hello'.*token_id"):
                await eng.complete([1], Sampling(max_tokens=1))

    run(go())


def test_load_list_unload_and_their_refusals() -> None:
    fake = FakeVLLM()

    async def go() -> None:
        eng, http = engine(fake, api_key="k")
        async with http:
            ms = await eng.load_adapter("run-v1", "/adapters/run/v1")
            assert ms >= 0
            assert await eng.loaded_adapters() == {"run-v1": "/adapters/run/v1"}
            with pytest.raises(AdapterLoadRefused, match="already been loaded") as caught:
                await eng.load_adapter("run-v1", "/adapters/run/v1")
            assert caught.value.adapter == "run-v1" and caught.value.status_code == 400
            await eng.unload_adapter("run-v1")
            assert await eng.loaded_adapters() == {}
            with pytest.raises(EngineResponseError, match="cannot be found"):
                await eng.unload_adapter("run-v1")
            info = await eng.info()
            assert (info.context_length, info.max_lora_rank) == (32768, 64)

    run(go())
    assert fake.requests[0][2] == {"lora_name": "run-v1", "lora_path": "/adapters/run/v1"}


def test_every_call_carries_vllms_api_key() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"object": "list", "data": []})

    async def go() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with http:
            await VLLMEngine(http, URL, api_key="sekret").loaded_adapters()
            await VLLMEngine(http, URL).loaded_adapters()

    run(go())
    assert seen == ["Bearer sekret", None]


def test_lending_memory_sleeps_or_drops_the_kv_cache_and_wakes() -> None:
    fake = FakeVLLM()

    async def go() -> None:
        eng, http = engine(fake)
        async with http:
            await eng.release_memory(["kv_cache"])
            await eng.resume_memory(["kv_cache"])
            await eng.release_memory(["kv_cache", "weights"])
            await eng.resume_memory(["kv_cache", "weights"])
            await eng.release_memory(None)
            await eng.resume_memory(None)
            await eng.flush_cache()

    run(go())
    assert [(m, p) for m, p, _ in fake.requests] == [
        ("POST", "/pause?mode=wait"), ("POST", "/release_kv_cache_memory"), ("POST", "/wake_up?tags=kv_cache"),
        ("POST", "/sleep?level=1&mode=wait"), ("POST", "/wake_up"),
        ("POST", "/sleep?level=1&mode=wait"), ("POST", "/wake_up"),
        ("POST", "/reset_prefix_cache")]


def test_a_wake_that_leaves_memory_asleep_and_a_failed_flush_raise() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/wake_up":
            return httpx.Response(200, json={"status": "sleeping", "tags": ["kv_cache"]})
        return httpx.Response(200, json={"success": False})

    async def go() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with http:
            eng = VLLMEngine(http, URL)
            with pytest.raises(EngineResponseError, match="asleep"):
                await eng.resume_memory(["kv_cache"])
            with pytest.raises(EngineResponseError, match="flush"):
                await eng.flush_cache()

    run(go())


def test_update_weights_reloads_between_a_pause_and_a_resume_even_when_it_fails() -> None:
    fake = FakeVLLM()

    async def go() -> None:
        eng, http = engine(fake)
        async with http:
            message = await eng.update_weights("/ckpt/step-3", abort_all_requests=True, version="step-3")
        assert "/ckpt/step-3" in message

    run(go())
    assert [(p, b) for _, p, b in fake.requests] == [
        ("/pause?mode=abort", None),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-3"}}),
        ("/update_weight_version", {"new_version": "step-3"}), ("/resume", None)]

    calls: list[str] = []

    def failing(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/collective_rpc":
            return error(500, "Model reloading with `dummy` format is not supported", "InternalServerError")
        return httpx.Response(200, json={"status": "ok"})

    async def go_failing() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(failing))
        async with http:
            with pytest.raises(EngineResponseError, match="dummy"):
                await VLLMEngine(http, URL).update_weights("/ckpt")

    run(go_failing())
    assert calls == ["/pause", "/collective_rpc", "/resume"]


def test_a_down_engine_is_unhealthy_and_unreachable_and_a_slow_one_times_out() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
            eng = VLLMEngine(http, URL, max_attempts=2)
            assert await eng.health() is False
            with pytest.raises(EngineUnreachable, match="TANDEM_ENGINE__URL"):
                await eng.load_adapter("a", "/p")
        async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as http:
            with pytest.raises(EngineTimeout):
                await VLLMEngine(http, URL, generate_timeout_s=1).complete([1], Sampling(max_tokens=1))

    run(go())


def test_from_settings_takes_the_key_rank_and_served_name() -> None:
    settings = EngineSettings(kind="vllm", url=URL + "/", served_model_name="qwen", max_lora_rank=32,
                              admin_api_key="k", load_timeout_s=7)
    http = httpx.AsyncClient()
    eng = VLLMEngine.from_settings(http, settings)
    run(http.aclose())
    assert (eng.url, eng.served_model_name, eng.max_lora_rank, eng.timeouts_s["load"]) == (URL, "qwen", 32, 7)
    assert eng._headers(CallKind.GENERATE) == eng._headers(CallKind.LOAD) == {"Authorization": "Bearer k"}
