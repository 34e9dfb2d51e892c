"""The gateway under load, on loopback with the real transformers engine and its pools wired as
main wires them: one engine call per request whatever its n, the controller's calls never
queued behind rollouts, admission with 429 + Retry-After, and engine work that stops when the
client leaves (measured with the engine's own count of generated tokens)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.loopback import held_stream_proxy, serve_app
from helpers.servers import gateway, inference_settings
from helpers.waiting import wait_until

from tandem.dev.metrics import metric
from tandem.settings import EngineSettings
from tandem_inference.engines.base import Sampling
from tandem_inference.engines.calls import ADMIN_CONNECTIONS, pool_limits
from tandem_inference.engines.transformers.client import TransformersEngine
from tandem_inference.engines.transformers.server import create_engine_app

pytestmark = pytest.mark.integration

LIMIT = 900
"""Long enough that a generation which is not stopped is plain in the engine's token count."""
LONG = {"model": "base", "prompt": "Count:", "max_tokens": LIMIT, "temperature": 0}
"""Greedy on the tiny model: runs to max_tokens without meeting its end-of-text token."""


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    with serve_app(create_engine_app(EngineSettings(model=str(tiny_model), device="cpu"))) as url:
        yield url


@pytest.fixture
def make_gateway(redis_url: str, redis_conn: redis.Redis, tmp_path: Path, engine_url: str, tiny_model: Path,
                 tokenizer: Any) -> Iterator[Callable[..., str]]:
    """Start a gateway with these gateway settings; it stops at the end of the test."""
    def start(**gw: Any) -> str:
        settings = inference_settings(redis_url, tmp_path / "store", engine_url, tiny_model, limit=LIMIT, **gw)
        return stack.enter_context(gateway(settings, tokenizer, with_controller=False))

    with ExitStack() as stack:
        yield start


def generated(engine_url: str) -> float:
    return metric(engine_url, "tandem_engine_generated_tokens_total")


def generate_calls(engine_url: str) -> float:
    return metric(engine_url, "tandem_engine_requests_total", route="/generate", status="200")


def burst(url: str, bodies: list[dict[str, Any]], *, timeout_s: float = 120) -> tuple[threading.Thread, list[Any]]:
    """Send `bodies` at once from a thread; the list fills with responses (or exceptions)."""
    out: list[Any] = []

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s,
                                     limits=httpx.Limits(max_connections=None)) as http:
            out.extend(await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies),
                                            return_exceptions=True))

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    return thread, out


# one engine call for n samples --------------------------------------------------------------
def test_n_samples_are_one_engine_call_streamed_or_not(make_gateway: Callable[..., str], engine_url: str) -> None:
    url = make_gateway()
    before = generate_calls(engine_url)
    body = {"model": "base", "prompt": "Count:", "max_tokens": 4, "n": 16, "logprobs": 1}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert [c["index"] for c in resp.json()["choices"]] == list(range(16))
    ext = resp.json()["tandem"]
    assert len(ext["completion_token_ids"]) == 16 and all(1 <= len(ids) <= 4 for ids in ext["completion_token_ids"])
    assert [len(c["logprobs"]["token_logprobs"]) for c in resp.json()["choices"]] == [
        len(ids) for ids in ext["completion_token_ids"]]

    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=streamed, timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    chunks = [httpx.Response(200, content=line[6:]).json() for line in lines]
    seen = {c["index"] for chunk in chunks for c in chunk["choices"]}
    finished = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert seen == set(range(16)) and sorted(finished) == list(range(16))
    ext = chunks[-1]["tandem"]
    assert len(ext["completion_token_ids"]) == 16 and chunks[-1]["usage"]["completion_tokens"] == sum(
        len(ids) for ids in ext["completion_token_ids"])
    assert generate_calls(engine_url) == before + 2  # not 2 x 16


def test_fan_out_n_sends_one_engine_call_per_sample(make_gateway: Callable[..., str], engine_url: str) -> None:
    url = make_gateway(fan_out_n=True)
    before = generate_calls(engine_url)
    resp = httpx.post(f"{url}/v1/completions", json={"model": "base", "prompt": "Count:", "max_tokens": 3, "n": 3},
                      timeout=60)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 3
    assert generate_calls(engine_url) == before + 3


def test_a_burst_of_n64_requests_leaves_the_gateway_responsive(
    make_gateway: Callable[..., str], engine_url: str
) -> None:
    url = make_gateway()
    before = generate_calls(engine_url)
    body = {"model": "base", "prompt": "Count:", "max_tokens": 4, "n": 64}
    thread, answers = burst(url, [body] * 50)
    wait_until(lambda: generate_calls(engine_url) > before, what="the burst reaching the engine")
    # while it runs: readiness and a small request answer, within a bounded wait
    assert httpx.get(f"{url}/ready", timeout=20).status_code == 200
    small = httpx.post(f"{url}/v1/completions", json={"model": "base", "prompt": "1", "max_tokens": 2}, timeout=20)
    assert small.status_code == 200, small.text
    thread.join(120)
    assert not thread.is_alive() and len(answers) == 50
    assert all(isinstance(a, httpx.Response) and a.status_code in (200, 429) for a in answers), answers[:3]
    served = sum(a.status_code == 200 for a in answers)
    assert served >= 1 and all(len(a.json()["choices"]) == 64 for a in answers if a.status_code == 200)
    assert generate_calls(engine_url) == before + served + 1  # one call each, not 64


@pytest.mark.asyncio
async def test_admin_calls_do_not_wait_behind_rollouts(engine_url: str) -> None:
    """A rollout pool with its one connection busy: health and adapter listings still answer."""
    async with (httpx.AsyncClient(limits=pool_limits(1)) as rollouts,
                httpx.AsyncClient(limits=pool_limits(ADMIN_CONNECTIONS)) as admin):
        engine = TransformersEngine(rollouts, engine_url, admin_http=admin, info_timeout_s=5)
        stream = engine.stream([5, 6, 7], Sampling(max_tokens=LIMIT, temperature=0))
        await stream.__anext__()  # the rollout pool's only connection is taken now
        try:
            assert await asyncio.wait_for(engine.health(), 10)
            assert await asyncio.wait_for(engine.loaded_adapters(), 10) == {}
        finally:
            await stream.aclose()


# admission ------------------------------------------------------------------------------------
def test_beyond_capacity_requests_are_refused_with_429_and_retry_after(
    make_gateway: Callable[..., str], engine_url: str
) -> None:
    url = make_gateway(max_in_flight_tokens=4096, max_queued_requests=2, retry_after_s=3)
    big = {"model": "base", "prompt": "Count:", "max_tokens": 500, "n": 8}  # 4000 tokens: one at a time
    thread, answers = burst(url, [big] * 50)
    wait_until(lambda: metric(url, "tandem_gateway_refused_total", reason="queue_full") >= 40,
               what="refusals")
    # saturated: readiness does not depend on rollouts, and a small request fits beside them
    assert httpx.get(f"{url}/ready", timeout=20).status_code == 200
    small = httpx.post(f"{url}/v1/completions", json={"model": "base", "prompt": "1", "max_tokens": 4}, timeout=20)
    assert small.status_code == 200, small.text
    thread.join(120)
    assert not thread.is_alive() and len(answers) == 50
    refused = [a for a in answers if a.status_code == 429]
    assert len(refused) >= 40 and all(a.status_code in (200, 429) for a in answers)
    for a in refused:
        assert a.headers["retry-after"] == "3"
        error = a.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == 429 and error["reason"] == "queue_full"
        assert "gateway.max_queued_requests=2" in error["message"]
    assert metric(url, "tandem_gateway_refused_total", reason="queue_full") == len(refused)
    wait_until(lambda: metric(url, "tandem_gateway_in_flight_tokens") == 0, what="admitted work released")
    assert metric(url, "tandem_gateway_queued_requests") == 0 and metric(url, "tandem_gateway_in_flight_sequences") == 0


def test_a_small_request_passes_an_overdue_large_one_which_gets_in_after_it(
    redis_url: str, tmp_path: Path, engine_url: str, tiny_model: Path, tokenizer: Any
) -> None:
    """Two streams hold the whole budget (the engine's streams are held after their first chunk); a
    large request waits past half of queue_timeout_s, then a small one arrives. When one stream's
    client leaves, the small request gets the room first and the large one the room it gives back."""
    chunk = {"model": "base", "prompt": "Count:", "max_tokens": 16, "stream": True}  # 16 tokens of budget
    with held_stream_proxy(engine_url) as (proxied, release):
        settings = inference_settings(redis_url, tmp_path / "store", proxied, tiny_model, limit=LIMIT,
                                      max_in_flight_tokens=32, queue_timeout_s=6)
        with ExitStack() as holders, gateway(settings, tokenizer, with_controller=False) as url:
            first, _ = (holders.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=chunk, timeout=60))
                        for _ in range(2))
            wait_until(lambda: metric(url, "tandem_gateway_in_flight_tokens") == 32, what="the budget held")
            large: list[int] = []

            def read_large() -> None:  # a stream too: once in, it holds its room until the release
                with httpx.stream("POST", f"{url}/v1/completions", json=chunk, timeout=60) as resp:
                    large.append(resp.status_code)
                    resp.read()

            reader = threading.Thread(target=read_large, daemon=True)
            reader.start()
            wait_until(lambda: metric(url, "tandem_gateway_queue_oldest_wait_seconds") >= 3, what="the large one overdue")
            thread, small = burst(url, [{"model": "base", "prompt": "1", "max_tokens": 4}], timeout_s=30)
            wait_until(lambda: metric(url, "tandem_gateway_queued_requests") == 2, what="the small one queued")
            first.close()  # its client leaves: 16 tokens free
            thread.join(30)
            assert isinstance(small[0], httpx.Response) and small[0].status_code == 200, small
            wait_until(lambda: metric(url, "tandem_gateway_queued_requests") == 0, what="the large one admitted")
            assert metric(url, "tandem_gateway_refused_total", reason="queue_timeout") == 0
            release.set()
            reader.join(30)
            assert large == [200]


# clients that leave ----------------------------------------------------------------------------
def settle(engine_url: str, before: float) -> float:
    """Tokens the engine generated since `before`, once what it was doing has ended.

    A one-token request waits for the model behind any generation still running (the engine
    runs one at a time), so after it returns only that request's token is new work.
    """
    httpx.post(f"{engine_url}/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}},
               timeout=120).raise_for_status()
    wait_until(lambda: generated(engine_url) >= before + 2, what="the engine counting its work")
    return generated(engine_url) - before - 1


@pytest.mark.parametrize("fan_out_n, n", [(False, 1), (False, 2), (True, 2)])
def test_a_stream_whose_client_leaves_stops_generating(
    make_gateway: Callable[..., str], engine_url: str, fan_out_n: bool, n: int
) -> None:
    url = make_gateway(fan_out_n=fan_out_n)
    before = generated(engine_url)
    for _ in range(3):
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "n": n, "stream": True}, timeout=60) as resp:
            assert resp.status_code == 200
            next(line for line in resp.iter_lines() if line.startswith("data: {"))
        # leaving the block closes the connection after the first chunk
    assert settle(engine_url, before) < 3 * n * LIMIT / 4
    wait_until(lambda: metric(url, "tandem_gateway_cancelled_total", route="/v1/completions") == 3,
               what="the cancellations counted")


def test_requests_whose_clients_give_up_stop_generating(
    make_gateway: Callable[..., str], engine_url: str
) -> None:
    url = make_gateway()
    before = generated(engine_url)
    prompts = ["1", "12", "1234", "Write"]  # four generations, which the engine runs one after another

    async def give_up() -> list[BaseException | httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, read=0.3)) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={**LONG, "prompt": p}) for p in prompts),
                                        return_exceptions=True)

    assert all(isinstance(r, httpx.ReadTimeout) for r in asyncio.run(give_up()))
    assert settle(engine_url, before) < len(prompts) * LIMIT / 4
    wait_until(lambda: metric(url, "tandem_gateway_cancelled_total", route="/v1/completions") == len(prompts),
               what="the cancellations counted")
    assert f'status="499"}} {float(len(prompts))}' in httpx.get(f"{url}/metrics").text
