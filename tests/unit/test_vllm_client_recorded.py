"""The vLLM client against what a real vLLM server answered.

tests/fixtures/vllm-<version>.json holds the exchanges bench/gpu/record_engine.py --engine vllm
recorded on a GPU with the version images/locks/vllm.txt pins, tandem's launch flags and dev
routes; they are replayed here through httpx.MockTransport (the network edge). Each replay also
checks that the client still sends what was recorded (method, path, query, body), so the bodies
vLLM accepted then are the bodies the client builds now.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.doctor import read_lock
from tandem_inference.engines.base import Sampling
from tandem_inference.engines.vllm import VLLMEngine
from tandem_inference.errors import AdapterLoadRefused, AdapterMissing, EngineResponseError
from tandem_inference.gateway.outputs import Output

FIXTURES = Path(__file__).parents[1] / "fixtures"
PINNED = read_lock(Path(__file__).parents[2] / "images" / "locks" / "vllm.txt")["vllm"]
RECORDED = json.loads((FIXTURES / f"vllm-{PINNED}.json").read_text())
BY_NAME = {e["name"]: e for e in RECORDED["exchanges"]}
URL = "http://vllm:8000"
PROMPT = [1, 18, 19, 20, 21]
SIX = Sampling(max_tokens=6, temperature=1.0)


def replay(*names: str) -> tuple[httpx.MockTransport, list[str]]:
    """A transport that answers the requests, in order, with the recorded exchanges `names` (the
    last one answers any further request, as a retried call sees it); also the names it served."""
    served: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        ex = BY_NAME[names[min(len(served), len(names) - 1)]]
        served.append(ex["name"])
        assert (request.method, request.url.raw_path.decode()) == (ex["method"], ex["path"]), ex["name"]
        if ex["request"] is not None:
            sent = json.loads(request.content)
            assert {k: v for k, v in sent.items() if k not in ("stream", "stream_options")} == \
                {k: v for k, v in ex["request"].items() if k not in ("stream", "stream_options")}, ex["name"]
        body = ex["response"]
        if isinstance(body, str):
            kind = ex.get("content_type") or "text/plain"
            return httpx.Response(ex["status"], text=body, headers={"content-type": kind})
        return httpx.Response(ex["status"], json=body)

    return httpx.MockTransport(handler), served


def client_for(*names: str) -> tuple[VLLMEngine, list[str]]:
    transport, served = replay(*names)
    return VLLMEngine(httpx.AsyncClient(transport=transport), URL, served_model_name="base", max_lora_rank=16), served


def choices(name: str) -> Iterable[dict[str, Any]]:
    return BY_NAME[name]["response"]["choices"]


async def test_a_load_returns_its_latency() -> None:
    client, _ = client_for("load_ok")
    assert await client.load_adapter("rec-v1", "/tmp/rec/adapters/good") >= 0


@pytest.mark.parametrize(
    ("name", "adapter", "path", "status", "fragment"),
    [
        ("load_duplicate", "rec-v1", "good", 400, "has already been loaded"),
        ("load_rank_too_big", "rec-big", "rank32", 500, "LoRA rank 32 is greater than max_lora_rank 16"),
        ("load_missing_path", "rec-missing", "nope", 404, "No adapter found"),
    ],
)
async def test_refused_loads_carry_vllms_message_and_status(
    name: str, adapter: str, path: str, status: int, fragment: str
) -> None:
    client, _ = client_for(name)
    with pytest.raises(AdapterLoadRefused) as info:
        await client.load_adapter(adapter, f"/tmp/rec/adapters/{path}")
    assert fragment in info.value.engine_message
    assert info.value.status_code == status and info.value.adapter == adapter


async def test_an_adapter_on_modules_beyond_attention_loads() -> None:
    # unlike SGLang (--lora-target-modules), vLLM serves LoRA on every linear module it supports
    client, _ = client_for("load_bad_target")
    assert await client.load_adapter("rec-mlp", "/tmp/rec/adapters/mlp") >= 0


async def test_a_completion_gives_ids_logprobs_and_the_finish() -> None:
    client, _ = client_for("complete_lora")
    (out,) = await client.complete(PROMPT, SIX, adapter="rec-v1")
    (choice,) = choices("complete_lora")
    assert out.token_ids == choice["token_ids"] and len(out.token_ids) == 6
    assert out.logprobs == choice["logprobs"]["token_logprobs"]
    assert all(lp <= 0 for lp in out.logprobs)
    assert out.finish_reason == "length"


async def test_n_samples_come_back_from_one_call_in_order() -> None:
    client, served = client_for("complete_n3")
    outs = await client.complete(PROMPT, SIX, n=3, adapter="rec-v1")
    assert served == ["complete_n3"]
    assert [o.index for o in outs] == [0, 1, 2]
    assert [o.token_ids for o in outs] == [c["token_ids"] for c in sorted(choices("complete_n3"), key=lambda c: c["index"])]


async def test_the_base_model_is_asked_for_by_the_served_name() -> None:
    client, _ = client_for("complete_base")
    (out,) = await client.complete(PROMPT, SIX)
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("name", ["complete_unknown_adapter", "complete_unloaded"])
async def test_an_adapter_vllm_does_not_hold_is_an_engine_error_naming_it(name: str) -> None:
    client, _ = client_for(name)
    adapter = BY_NAME[name]["request"]["model"]
    with pytest.raises(AdapterMissing) as info:
        await client.complete(PROMPT, SIX, adapter=adapter)
    assert info.value.status_code == 404
    assert f"`{adapter}` does not exist" in info.value.engine_message


async def test_a_stream_of_two_samples_folds_into_each_samples_tokens() -> None:
    client, _ = client_for("complete_stream")
    outs = [Output(), Output()]
    async for piece in client.stream(PROMPT, SIX, n=2, adapter="rec-v1"):
        outs[piece.index].update(piece)
    for out in outs:
        assert len(out.token_ids) == 6 and len(out.logprobs) == 6
        assert out.finish_reason == "length"
    assert outs[0].token_ids != outs[1].token_ids


async def test_the_prefix_cache_is_reported_on_the_second_long_prompt() -> None:
    first, _ = client_for("complete_prefix_1")
    second, _ = client_for("complete_prefix_2")
    (cold,) = await first.complete(PROMPT * 40, Sampling(max_tokens=2, temperature=1.0), adapter="rec-v1")
    (warm,) = await second.complete(PROMPT * 40, Sampling(max_tokens=2, temperature=1.0), adapter="rec-v1")
    assert cold.cached_tokens == 0 and warm.cached_tokens == 192  # whole 16-token blocks of the 200


async def test_loaded_adapters_and_the_context_length_come_from_v1_models() -> None:
    empty, _ = client_for("models_empty")
    assert await empty.loaded_adapters() == {}
    loaded, _ = client_for("models_loaded")
    assert await loaded.loaded_adapters() == {"rec-v1": "/tmp/rec/adapters/good", "rec-mlp": "/tmp/rec/adapters/mlp"}
    info = await loaded.info()
    assert info.context_length == 1024 and info.max_lora_rank == 16  # the rank: what the launcher passed


async def test_health_is_an_empty_200() -> None:
    client, _ = client_for("health")
    assert await client.health() is True


async def test_an_unload_returns_and_an_unknown_one_is_refused_by_name() -> None:
    ok, _ = client_for("unload_ok")
    await ok.unload_adapter("rec-v1")
    unknown, _ = client_for("unload_unknown")
    with pytest.raises(EngineResponseError) as info:
        await unknown.unload_adapter("never-loaded")
    assert info.value.status_code == 404 and "never-loaded" in str(info.value)


async def test_lending_the_kv_cache_pauses_then_releases_and_its_wake_alone_resumes() -> None:
    # recorded: after /wake_up?tags=kv_cache a completion ran before any /resume
    assert BY_NAME["complete_after_kv_wake"]["status"] == 200
    client, served = client_for("pause", "release_kv_cache")
    await client.release_memory(["kv_cache"])
    assert served == ["pause", "release_kv_cache"]
    client, served = client_for("wake_kv_cache")
    await client.resume_memory(["kv_cache"])
    assert served == ["wake_kv_cache"]


async def test_lending_the_weights_is_sleep_level_1_and_wake_up() -> None:
    assert BY_NAME["complete_after_wake"]["status"] == 200
    client, served = client_for("sleep")
    await client.release_memory(None)
    client_w, served_w = client_for("wake_up")
    await client_w.resume_memory(None)
    assert served + served_w == ["sleep", "wake_up"]


async def test_a_weight_reload_is_pause_reload_version_resume() -> None:
    assert BY_NAME["complete_after_reload"]["status"] == 200
    client, served = client_for("reload_pause", "reload_weights", "weight_version", "reload_resume")
    said = await client.update_weights("/tmp/rec/model", version="rec-1")
    assert served == ["reload_pause", "reload_weights", "weight_version", "reload_resume"]
    assert "/tmp/rec/model" in said


async def test_flush_cache_and_metrics() -> None:
    client, _ = client_for("flush_cache")
    await client.flush_cache()
    metrics, _ = client_for("metrics")
    assert "vllm:num_requests_running" in await metrics.metrics()


def test_the_recording_is_the_pinned_version() -> None:
    assert RECORDED["vllm"] == PINNED == "0.33.0"
