"""Each engine client's `metrics()` against httpx.MockTransport: the engine's own Prometheus text,
asked for in the format the gateway relays, bounded in size and time, failures as tandem errors.

SGLang's and vLLM's bodies are tests/fixtures/engine-metrics/ (vLLM's recorded from vLLM 0.33.0 on a
GPU; SGLang's names, types and labels written by hand from its source); the transformers engine's is
its own registry's text.
"""

from __future__ import annotations

import asyncio
import gzip
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem_inference.engines.base import METRICS_FORMAT
from tandem_inference.engines.calls import METRICS_MAX_BYTES, CallKind
from tandem_inference.engines.http import HttpEngine
from tandem_inference.engines.sglang import SGLangEngine
from tandem_inference.engines.transformers.client import TransformersEngine
from tandem_inference.engines.transformers.metrics import EngineMetrics
from tandem_inference.engines.vllm import VLLMEngine
from tandem_inference.errors import EngineResponseError, EngineTimeout, EngineUnreachable

FIXTURES = Path(__file__).parents[1] / "fixtures" / "engine-metrics"
URL = "http://127.0.0.1:30000"
KEY = "admin-key"
Handler = Callable[[httpx.Request], httpx.Response]


def body_of(kind: str) -> str:
    if kind == "transformers":
        metrics = EngineMetrics()
        metrics.generated_tokens.inc(7)
        return generate_latest(metrics.registry).decode()
    return (FIXTURES / f"{kind}.txt").read_text()


def client(kind: str, handler: Handler) -> HttpEngine:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    if kind == "vllm":
        return VLLMEngine(http, URL, served_model_name="base", api_key=KEY)
    return (SGLangEngine if kind == "sglang" else TransformersEngine)(http, URL, api_key=KEY)


def prometheus_text(body: bytes | str, **headers: str) -> httpx.Response:
    """A reply as prometheus_client's exposition writes it when no format is asked for."""
    return httpx.Response(200, content=body, headers={"content-type": "text/plain; version=0.0.4; charset=utf-8",
                                                      **headers})


@pytest.mark.parametrize("kind", ["sglang", "vllm", "transformers"])
async def test_metrics_is_the_engines_own_text_asked_for_in_the_relayed_format(kind: str) -> None:
    body = body_of(kind)
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return prometheus_text(body)

    text = await client(kind, handler).metrics()
    assert text == body
    names = {family.name for family in text_string_to_metric_families(text)}
    prefix = {"sglang": "sglang:", "vllm": "vllm:", "transformers": "tandem_engine_"}[kind]
    assert any(name.startswith(prefix) for name in names)  # beside the runtime's python_* and process_*
    [request] = seen  # one attempt
    assert (request.method, request.url.path) == ("GET", "/metrics")
    assert request.headers["accept"] == METRICS_FORMAT
    assert request.headers["authorization"] == f"Bearer {KEY}"  # SGLang's admin key, vLLM's one key


async def test_a_gzipped_reply_is_read_as_its_text() -> None:
    """prometheus_client's ASGI app (SGLang's and vLLM's /metrics) gzips when the client accepts it, as httpx does."""
    body = body_of("sglang")

    def handler(request: httpx.Request) -> httpx.Response:
        assert "gzip" in request.headers["accept-encoding"]
        return prometheus_text(gzip.compress(body.encode()), **{"content-encoding": "gzip"})

    assert await client("sglang", handler).metrics() == body


async def test_an_endless_reply_is_refused_once_it_passes_the_bound() -> None:
    sent: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        line = b'sglang:num_running_reqs{model_name="base"} 1.0\n' * 1024
        while True:
            sent.append(len(line))
            yield line

    def handler(request: httpx.Request) -> httpx.Response:
        return prometheus_text(endless())  # type: ignore[arg-type]

    with pytest.raises(EngineResponseError, match=f"more than {METRICS_MAX_BYTES} bytes") as caught:
        await client("vllm", handler).metrics()
    assert caught.value.status_code == 200
    assert METRICS_MAX_BYTES < sum(sent) <= METRICS_MAX_BYTES + 2 * sent[0]  # read no further than the bound


async def test_an_engine_that_trickles_is_cut_at_the_calls_deadline() -> None:
    """httpx's timeouts bound each read; the call as a whole is bounded too."""

    async def trickle() -> AsyncIterator[bytes]:
        while True:
            yield b"# still here\n"
            await asyncio.sleep(0.05)

    engine = client("sglang", lambda request: prometheus_text(trickle()))  # type: ignore[arg-type]
    engine.timeouts_s[CallKind.METRICS] = 0.3
    with pytest.raises(EngineTimeout, match="did not answer the metrics call whole within 0.3 s"):
        await engine.metrics()


@pytest.mark.parametrize(
    ("reply", "error", "fragment"),
    [
        # SGLang started without --enable-metrics: FastAPI's 404
        (httpx.Response(404, json={"detail": "Not Found"}), EngineResponseError, "failed the metrics (404): Not Found"),
        (httpx.Response(503, text="starting"), EngineUnreachable, "not ready (503): starting"),
        (httpx.Response(200, content=b"sglang:x 1.0 \xff\xfe\n"), EngineResponseError, "not UTF-8"),
    ],
    ids=["no-metrics", "not-ready", "not-utf8"],
)
async def test_a_failed_reply_is_a_tandem_error_naming_the_engine(
    reply: httpx.Response, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=re.escape(fragment)) as caught:
        await client("sglang", lambda request: reply).metrics()
    assert f"engine at {URL}/metrics" in str(caught.value)


async def test_an_engine_that_is_down_is_unreachable_after_one_attempt() -> None:
    attempts: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(request)
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(EngineUnreachable, match="cannot be reached for the metrics"):
        await client("vllm", handler).metrics()
    assert len(attempts) == 1  # the scraper's next scrape is the retry


async def test_scrapes_at_once_share_one_read_and_leave_the_admin_calls_alone() -> None:
    """/metrics/engine takes no key: however many scrapes arrive while a read is in flight, the engine
    is asked once (the admin pool keeps its connections for loads and health), each scrape gets the
    answer, and a scrape that goes away does not cancel the read for the others."""
    reads, release = 0, asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal reads
        if request.url.path == "/health":
            return httpx.Response(200, json={})
        reads += 1
        await release.wait()
        return prometheus_text(body_of("sglang"))

    engine = SGLangEngine(httpx.AsyncClient(transport=httpx.MockTransport(handler)), URL, api_key=KEY)
    scrapes = [asyncio.create_task(engine.metrics()) for _ in range(10)]
    await asyncio.sleep(0.05)
    await asyncio.wait_for(engine.health(), 1.0)  # answered while the read waits
    scrapes[0].cancel()
    release.set()
    texts = await asyncio.gather(*scrapes[1:])
    assert reads == 1 and texts == [body_of("sglang")] * 9
    assert await engine.metrics() == body_of("sglang") and reads == 2  # the next scrape reads anew
