"""The engine client against what real SGLang servers answered.

tests/fixtures/sglang-<version>.json holds exchanges recorded by bench/gpu/record_engine.py on a
GPU; they are replayed here through httpx.MockTransport (the network edge), so the client's
parsing and error translation are checked against the server's real bodies. The recording of
the SGLang the image pins (images/locks/sglang.txt) is the reference; the one of 0.5.12 keeps
the hung unload that release answered with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.doctor import read_lock
from tandem_inference.engines.base import Sampling
from tandem_inference.engines.sglang import SGLangEngine
from tandem_inference.errors import (
    AdapterLoadRefused,
    AdapterMissing,
    EngineClientError,
    EngineResponseError,
    EngineTimeout,
)
from tandem_inference.gateway.outputs import Output

FIXTURES = Path(__file__).parents[1] / "fixtures"
PINNED = read_lock(Path(__file__).parents[2] / "images" / "locks" / "sglang.txt")["sglang"]
RECORDED = json.loads((FIXTURES / f"sglang-{PINNED}.json").read_text())
BY_NAME = {e["name"]: e for e in RECORDED["exchanges"]}
HUNG = {e["name"]: e for e in json.loads((FIXTURES / "sglang-0.5.12.json").read_text())["exchanges"]}
URL = "http://sglang:30000"
SIX = Sampling(max_tokens=6)


def replay(name: str, recording: dict[str, Any] | None = None) -> httpx.MockTransport:
    """A transport that answers every request with the recorded exchange `name`."""
    ex = (recording or BY_NAME)[name]

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.method == ex["method"] and request.url.path == ex["path"]
        if ex["status"] == "timeout":
            raise httpx.ReadTimeout("recorded: the server never answered", request=request)
        body = ex["response"]
        if isinstance(body, str):
            return httpx.Response(ex["status"], text=body, headers={"content-type": ex.get("content_type") or "text/plain"})
        return httpx.Response(ex["status"], json=body)

    return httpx.MockTransport(handler)


async def client_for(name: str, recording: dict[str, Any] | None = None, **kw: Any) -> SGLangEngine:
    return SGLangEngine(httpx.AsyncClient(transport=replay(name, recording)), URL, **kw)


async def test_a_load_returns_its_latency() -> None:
    client = await client_for("load_ok")
    assert await client.load_adapter("rec-v1", "/tmp/rec/adapters/good") >= 0


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("load_duplicate", "already loaded"),
        ("load_rank_too_big", "--max-lora-rank"),
        ("load_bad_target", "incompatible with the current LoRA memory pool"),
        ("load_missing_path", "Repo id must be in the form"),
    ],
)
async def test_refused_loads_carry_sglangs_message(name: str, fragment: str) -> None:
    client = await client_for(name)
    with pytest.raises(AdapterLoadRefused) as info:
        await client.load_adapter("x", "/tmp/x")
    assert fragment in info.value.engine_message
    assert info.value.status_code == 400


async def test_generate_with_an_adapter_gives_ids_and_logprobs() -> None:
    client = await client_for("generate_lora")
    (out,) = await client.complete([1, 18, 19, 20, 21], SIX, adapter="rec-v1")
    assert out.token_ids == BY_NAME["generate_lora"]["response"]["output_ids"]
    assert len(out.logprobs) == len(out.token_ids) == 6
    assert all(lp <= 0 for lp in out.logprobs)
    assert out.finish_reason == "length"


async def test_an_adapter_never_loaded_is_an_engine_error_naming_it() -> None:
    client = await client_for("generate_unknown_adapter")
    with pytest.raises(AdapterMissing) as info:
        await client.complete([1, 2], Sampling(max_tokens=2), adapter="never-loaded")
    assert info.value.status_code == 400
    assert "never been loaded: never-loaded" in info.value.engine_message


async def test_a_stream_folds_into_the_same_tokens() -> None:
    client = await client_for("generate_stream")
    out = Output()
    async for piece in client.stream([1, 18, 19, 20, 21], SIX, adapter="rec-v1"):
        out.update(piece)
    assert len(out.token_ids) == 6 and len(out.logprobs) == 6
    assert out.finish_reason == "length"


async def test_loaded_adapters_come_from_v1_models() -> None:
    assert await (await client_for("models_empty")).loaded_adapters() == {}
    loaded = await (await client_for("models_loaded")).loaded_adapters()
    assert loaded == {"rec-v1": "/tmp/rec/adapters/good"}


async def test_server_info_tells_the_max_rank_and_health_is_an_empty_200() -> None:
    info = await (await client_for("server_info")).info()
    assert info.max_lora_rank == 16 and info.context_length is None  # SGLang says only when set
    assert await (await client_for("health")).health() is True


async def test_an_unload_returns_and_an_unknown_one_is_refused_by_name() -> None:
    await (await client_for("unload_ok")).unload_adapter("rec-v1")
    with pytest.raises(EngineResponseError) as info:
        await (await client_for("unload_unknown")).unload_adapter("never-loaded")
    assert info.value.status_code == 400 and "never-loaded" in str(info.value)


async def test_a_hung_unload_becomes_a_timeout() -> None:
    # NOTE: recorded with SGLang 0.5.12: after failed requests on the adapter, its unload never
    # returned (the use-count leak, #34205); the controller restarts the engine after repeats.
    client = await client_for("unload_ok", HUNG, unload_timeout_s=0.5)
    with pytest.raises(EngineTimeout):
        await client.unload_adapter("rec-v1")


async def test_memory_release_and_resume_answer_empty_200s() -> None:
    await (await client_for("release_memory")).release_memory(["kv_cache"])
    await (await client_for("resume_memory")).resume_memory(["kv_cache"])


def test_the_recording_is_the_pinned_version() -> None:
    assert RECORDED["sglang"] == PINNED == "0.5.23"
    assert issubclass(EngineTimeout, EngineClientError)
