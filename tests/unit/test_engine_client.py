"""The SGLang engine client against httpx.MockTransport: requests, error translation, timeouts, retries."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from tandem.settings import EngineSettings
from tandem_inference.engines import calls as engine_calls
from tandem_inference.engines.base import Sampling
from tandem_inference.engines.calls import CallKind, should_retry
from tandem_inference.engines.sglang import SGLangEngine
from tandem_inference.errors import (
    AdapterLoadFailed,
    AdapterLoadRefused,
    AdapterMissing,
    EngineClientError,
    EngineError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
    EngineUnreachable,
)

BASE = "http://engine.test:30000"
TWO = Sampling(max_tokens=2)


@pytest.fixture(autouse=True)
def _no_retry_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_calls, "RETRY_PAUSE_S", 0.0)


def make_client(handler: Callable[[httpx.Request], httpx.Response], **kw) -> SGLangEngine:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return SGLangEngine(http, BASE, **kw)


def generate_reply(ids: list[int]) -> dict:
    return {
        "text": "hi",
        "output_ids": ids,
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length", "length": len(ids)},
            "completion_tokens": len(ids),
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        },
    }


async def test_complete_sends_the_native_request_and_returns_the_sample() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(
            {
                "path": request.url.path,
                "body": json.loads(request.content),
                "auth": request.headers.get("authorization"),
            }
        )
        return httpx.Response(200, json=generate_reply([7, 8]))

    client = make_client(handler, api_key="secret")
    (out,) = await client.complete([1, 2, 3], TWO, adapter="digits-v3")
    assert (out.token_ids, out.logprobs, out.text, out.finish_reason) == ([7, 8], [-0.5, -0.5], "hi", "length")
    assert seen == [
        {
            "path": "/generate",
            "auth": None,
            "body": {
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0},
                "return_logprob": True,
                "logprob_start_len": -1,
                "lora_path": "digits-v3",
            },
        }
    ]
    await client.complete([1], Sampling(max_tokens=3, temperature=0.0, stop=("\n",), top_logprobs=2, ignore_eos=True))
    assert seen[-1]["body"] == {
        "input_ids": [1],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0, "stop": ["\n"], "ignore_eos": True},
        "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 2,
    }


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (400, {"error": {"message": "prompt too long"}}, "prompt too long"),
        (
            400,
            {"object": "error", "message": "flat openai error", "type": "BadRequestError"},
            "flat openai error",
        ),
        (500, {"detail": "internal"}, "internal"),
        (500, "plain text failure", "plain text failure"),
    ],
)
async def test_generate_errors_carry_the_engine_message_and_url(
    status: int, body: object, expected: str
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    with pytest.raises(EngineResponseError) as info:
        await make_client(handler).complete([1], TWO)
    assert info.value.status_code == status
    assert info.value.engine_message == expected
    assert f"{BASE}/generate" in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize("status", [400, 200])
async def test_load_refusal_is_adapter_load_refused_with_the_engine_message(status: int) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            status, json={"success": False, "error_message": "rank 128 > max 64", "loaded_adapters": {}}
        )

    with pytest.raises(AdapterLoadRefused) as info:
        await make_client(handler).load_adapter("digits-v4", "/store/digits/v000004/adapter")
    assert info.value.adapter == "digits-v4"
    assert info.value.engine_message == "rank 128 > max 64"
    assert "digits-v4" in str(info.value) and "/load_lora_adapter" in str(info.value)


async def test_load_returns_ms_and_sends_name_path_and_admin_key() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200, json={"success": True, "error_message": None, "loaded_adapters": {"digits-v1": "/a"}}
        )

    ms = await make_client(handler, api_key="secret").load_adapter("digits-v1", "/a")
    assert ms >= 0.0
    assert json.loads(seen[0].content) == {"lora_name": "digits-v1", "lora_path": "/a"}
    assert seen[0].headers["authorization"] == "Bearer secret"


async def test_engine_503_and_connection_errors_are_engine_unavailable() -> None:
    def busy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "memory released"}})

    with pytest.raises(EngineUnreachable, match="memory released"):
        await make_client(busy).complete([1], TWO)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(EngineUnreachable, match="engine.test:30000/unload_lora_adapter") as info:
        await make_client(refused).unload_adapter("digits-v1")
    assert "digits-v1" in str(info.value)
    assert not isinstance(info.value, EngineTimeout)


async def test_read_timeout_is_engine_timeout_naming_the_limit() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(EngineTimeout, match="within 7 s"):
        await make_client(slow, unload_timeout_s=7).unload_adapter("digits-v1")


async def test_each_call_kind_uses_its_own_timeout() -> None:
    timeouts: dict[str, float] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        timeouts[request.url.path] = request.extensions["timeout"]["read"]
        if request.url.path == "/generate":
            return httpx.Response(200, json=generate_reply([1]))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": []})
        return httpx.Response(200, json={"success": True})

    settings = EngineSettings(url=BASE, load_timeout_s=61, unload_timeout_s=31, generate_timeout_s=301)
    client = SGLangEngine.from_settings(httpx.AsyncClient(transport=httpx.MockTransport(handler)), settings)
    await client.complete([1], TWO)
    await client.load_adapter("r-v1", "/p")
    await client.unload_adapter("r-v1")
    await client.health()
    await client.loaded_adapters()
    assert timeouts == {
        "/generate": 301,
        "/load_lora_adapter": 61,
        "/unload_lora_adapter": 31,
        "/health": engine_calls.INFO_TIMEOUT_S,
        "/v1/models": engine_calls.INFO_TIMEOUT_S,
    }


@pytest.mark.parametrize(
    ("kind", "exc", "attempt", "expected"),
    [
        (CallKind.INFO, httpx.ConnectError("x"), 1, True),
        (CallKind.GENERATE, httpx.RemoteProtocolError("x"), 2, True),
        (CallKind.FLUSH, httpx.ConnectTimeout("x"), 1, True),
        (CallKind.INFO, httpx.ConnectError("x"), 3, False),  # bounded
        (CallKind.GENERATE, httpx.ReadTimeout("x"), 1, False),  # slow, not disconnected
        (CallKind.LOAD, httpx.ConnectError("x"), 1, False),  # a second load is refused
        (CallKind.UNLOAD, httpx.ConnectError("x"), 1, False),
        (CallKind.MEMORY, httpx.ConnectError("x"), 1, False),
        (CallKind.INFO, ValueError("x"), 1, False),
    ],
)
def test_retry_predicate(kind: CallKind, exc: BaseException, attempt: int, expected: bool) -> None:
    assert should_retry(kind, exc, attempt) is expected


async def test_idempotent_calls_retry_connection_errors_a_bounded_number_of_times() -> None:
    calls: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) < 3:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"max_lora_rank": 16})

    assert (await make_client(flaky).info()).max_lora_rank == 16
    assert calls == ["/server_info"] * 3

    calls.clear()

    def down(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(EngineUnreachable):
        await make_client(down).complete([1], TWO)
    assert len(calls) == engine_calls.MAX_ATTEMPTS

    calls.clear()
    with pytest.raises(EngineUnreachable):
        await make_client(down).load_adapter("r-v1", "/p")
    assert calls == ["/load_lora_adapter"]


async def test_health_is_false_instead_of_raising() -> None:
    assert await make_client(lambda r: httpx.Response(200, json={})).health() is True
    assert await make_client(lambda r: httpx.Response(503, text="warming up")).health() is False

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    assert await make_client(refused).health() is False


async def test_loaded_adapters_lists_adapter_cards_only() -> None:
    body = {
        "object": "list",
        "data": [
            {"id": "base", "root": "/models/tiny", "parent": None},
            {"id": "digits-v2", "root": "/store/digits/v000002/adapter", "parent": "base"},
        ],
    }
    client = make_client(lambda r: httpx.Response(200, json=body))
    assert await client.loaded_adapters() == {"digits-v2": "/store/digits/v000002/adapter"}


async def test_admin_routes_send_the_key_and_memory_body() -> None:
    seen: list[tuple[str, str | None, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization"), request.content))
        return httpx.Response(200, json={"success": True})

    client = make_client(handler, api_key="k")
    await client.flush_cache()
    await client.release_memory()
    await client.resume_memory(["weights"])
    assert [(p, a) for p, a, _ in seen] == [
        ("/flush_cache", "Bearer k"),
        ("/release_memory_occupation", "Bearer k"),
        ("/resume_memory_occupation", "Bearer k"),
    ]
    assert json.loads(seen[1][2]) == {"tags": None} and json.loads(seen[2][2]) == {"tags": ["weights"]}


async def test_update_weights_sends_sglang_body_key_and_timeout_and_raises_on_refusal() -> None:
    seen: list[tuple[str | None, dict, float]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.headers.get("authorization"), body, request.extensions["timeout"]["read"]))
        if body["model_path"] == "/bad":
            reply = {"success": False, "message": "config.json has hidden_size=32", "num_paused_requests": 0}
            return httpx.Response(400, json=reply)
        return httpx.Response(200, json={"success": True, "message": "Succeeded to update model weights.",
                                          "num_paused_requests": 0})

    client = make_client(handler, api_key="k", weights_timeout_s=123)
    assert await client.update_weights("/merged", version="v7") == "Succeeded to update model weights."
    assert seen[0] == ("Bearer k", {"model_path": "/merged", "abort_all_requests": False, "weight_version": "v7"}, 123)
    with pytest.raises(EngineResponseError, match="hidden_size=32") as info:
        await client.update_weights("/bad")
    assert info.value.status_code == 400 and len(seen) == 2  # a refit is never retried


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n".encode() for e in events)


async def test_stream_yields_increments_until_done() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is True
        return httpx.Response(
            200,
            content=sse(generate_reply([5]), generate_reply([5, 6]), "[DONE]"),
            headers={"content-type": "text/event-stream"},
        )

    pieces = [g async for g in make_client(handler).stream([1], TWO)]
    assert [(g.token_ids, g.logprobs) for g in pieces] == [([5], [-0.5]), ([6], [-0.5])]


async def test_stream_of_n_samples_names_each_increments_sample() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["sampling_params"]["n"] == 2
        return httpx.Response(200, content=sse({**generate_reply([5]), "index": 1}, {**generate_reply([7]), "index": 0},
                                               {**generate_reply([5, 6]), "index": 1}, "[DONE]"))

    pieces = [(g.index, g.token_ids) async for g in make_client(handler).stream([1], TWO, n=2)]
    assert pieces == [(1, [5]), (0, [7]), (1, [6])]


async def test_stream_error_event_raises_with_the_engine_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse(generate_reply([5]), {"error": {"message": "oom"}}, "[DONE]"))

    got = []
    with pytest.raises(EngineResponseError, match="oom"):
        async for piece in make_client(handler).stream([1], TWO):
            got.append(piece)
    assert len(got) == 1


async def test_a_generation_naming_an_adapter_the_engine_lacks_is_adapter_missing() -> None:
    """SGLang's 400 for an adapter it does not hold is tandem's fault (a 502 at the gateway), not the client's."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "Got LoRA adapter that has never been loaded"}})

    with pytest.raises(AdapterMissing, match="never been loaded") as info:
        async for _ in make_client(handler).stream([1], TWO, adapter="x-v9"):
            pass
    assert info.value.status_code == 400
    with pytest.raises(AdapterMissing):
        await make_client(handler).complete([1], TWO, adapter="x-v9")


async def test_n_samples_are_one_call_with_n_and_come_back_in_order() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        n = seen[-1]["sampling_params"].get("n", 1)
        if n == 1:
            return httpx.Response(200, json=generate_reply([1]))
        return httpx.Response(200, json=[{**generate_reply([i]), "index": i} for i in reversed(range(n))])

    client = make_client(handler)
    outs = await client.complete([1, 2], Sampling(max_tokens=1), n=3)
    assert [(o.index, o.token_ids) for o in outs] == [(0, [0]), (1, [1]), (2, [2])]
    assert len(seen) == 1 and seen[0]["sampling_params"]["n"] == 3
    assert [o.token_ids for o in await client.complete([1], Sampling(max_tokens=1))] == [[1]]
    assert "n" not in seen[1]["sampling_params"]


async def test_a_reply_with_the_wrong_number_of_samples_is_refused() -> None:
    client = make_client(lambda r: httpx.Response(200, json=[generate_reply([1])] * 2))
    with pytest.raises(EngineResponseError, match="answered 2 outputs for n=3"):
        await client.complete([1], TWO, n=3)


async def test_generation_and_admin_calls_use_separate_pools() -> None:
    used: list[tuple[str, str]] = []

    def pool(name: str) -> httpx.AsyncClient:
        def handler(request: httpx.Request) -> httpx.Response:
            used.append((name, request.url.path))
            if request.url.path == "/generate":
                return httpx.Response(200, json=generate_reply([1]))
            return httpx.Response(200, json={"success": True, "data": []})

        return httpx.AsyncClient(transport=httpx.MockTransport(handler))

    client = SGLangEngine(pool("rollouts"), BASE, admin_http=pool("admin"))
    await client.complete([1], TWO)
    await client.load_adapter("a-v1", "/adapters/a/v1")
    assert await client.health()
    await client.loaded_adapters()
    assert used == [("rollouts", "/generate"), ("admin", "/load_lora_adapter"), ("admin", "/health"),
                    ("admin", "/v1/models")]


def test_the_clients_errors_are_a_branch_apart_from_the_engine_servers() -> None:
    """What the client raises is never mistaken for what the transformers engine raises, and back."""
    for client_error in (EngineUnreachable, EngineTimeout, EngineResponseError, AdapterLoadRefused):
        assert issubclass(client_error, EngineClientError) and not issubclass(client_error, EngineError)
    for server_error in (EngineUnavailable, AdapterLoadFailed):
        assert not issubclass(server_error, EngineClientError)
