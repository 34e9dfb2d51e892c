"""More adapter versions than engine slots: 256 versions of 64 runs through an engine of 8 slots.

The real transformers engine on the tiny model holds at most 8 adapters (it refuses a ninth
load); the real gateway and its controller stand in front of it, with a real Redis. 64 runs
publish 4 versions each, announced with `adapter_ready` as the trainer does. Then a few hundred
requests, a dozen at a time, ask for random `run@vN` (and plain `run`, its newest version): each
needs its version loaded on demand, evicting the least recently used adapter no request holds.

Which version answered is checked by its output, not by what the gateway says: every version
has LoRA weights of its own (drawn from its own seed), and its greedy completion -- token ids and
logprobs -- was computed beforehand by a second engine that loaded that version alone, by path,
bypassing the gateway, the controller and the routing table. The references of the versions asked
for differ pairwise, so an answer from any other version would not match.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.adapters import ATTENTION_QV, announce, publish_reseeded
from helpers.loopback import serve_app
from helpers.servers import BASE, gateway, inference_settings
from helpers.waiting import wait_until

from tandem.acl import Role
from tandem.adapters import AdapterStore, Manifest
from tandem.dev.metrics import metric
from tandem.events import EventKind, EventStream
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.settings import EngineSettings
from tandem_inference.engines.base import Sampling
from tandem_inference.engines.transformers.client import TransformersEngine
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_trainer.tiny_model import build_random_adapter

pytestmark = pytest.mark.integration

RUNS, VERSIONS, SLOTS = 64, 4, 8
REQUESTS, CONCURRENCY = 200, 12
PROMPT = [11, 23, 5, 42, 7]
MAX_TOKENS = 3
LOGPROB_TOLERANCE = 1e-3

Reference = tuple[list[int], list[float]]


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    """The engine under test: room for SLOTS adapters, no more (its own refusal past that)."""
    settings = EngineSettings(model=str(tiny_model), device="cpu", max_lora_rank=16, max_loaded_adapters=SLOTS,
                              served_model_name=BASE, max_new_tokens_limit=MAX_TOKENS)
    with serve_app(create_engine_app(settings)) as url:
        yield url


def publish_all(redis_conn: redis.Redis, store: AdapterStore, tiny_model: Path, template: Path) -> list[Manifest]:
    """RUNS runs of VERSIONS versions each, every version with weights of its own seed."""
    registry = Registry(redis_conn)
    prefix = f"cap{uuid.uuid4().hex[:4]}"
    manifests = []
    for i in range(RUNS):
        run = f"{prefix}-{i:02d}"
        registry.create_run(RunSpec(name=run, base_model=str(tiny_model)))
        for version in range(1, VERSIONS + 1):
            manifests.append(publish_reseeded(store, registry, template, tiny_model, run, version,
                                              seed=1000 + i * VERSIONS + version))
    return manifests


async def references(tiny_model: Path, store: AdapterStore, manifests: list[Manifest]) -> dict[tuple[str, int], Reference]:
    """Each version's greedy completion of PROMPT, from an engine that loaded it alone, by path."""
    settings = EngineSettings(model=str(tiny_model), device="cpu", max_lora_rank=16, max_loaded_adapters=SLOTS)
    out: dict[tuple[str, int], Reference] = {}
    with serve_app(create_engine_app(settings)) as url:
        async with httpx.AsyncClient(timeout=60) as http:
            engine = TransformersEngine(http, url)
            for m in manifests:
                name = f"ref-{m.run}-v{m.version}"
                await engine.load_adapter(name, str(store.adapter_dir(m.run, m.version)))
                (gen,) = await engine.complete(PROMPT, Sampling(max_tokens=MAX_TOKENS, temperature=0), adapter=name)
                await engine.unload_adapter(name)
                out[(m.run, m.version)] = (list(gen.token_ids), list(gen.logprobs or []))
    return out


def wrong(answer: dict[str, Any], expected: Reference) -> bool:
    """Whether a completion differs from the reference of the version it was asked for."""
    (ids,), (logprobs,) = answer["completion_token_ids"], answer["completion_logprobs"]
    ref_ids, ref_logprobs = expected
    return ids != ref_ids or any(abs(a - b) > LOGPROB_TOLERANCE for a, b in zip(logprobs, ref_logprobs, strict=True))


async def load(url: str, plan: list[tuple[str, int | None]]) -> list[httpx.Response]:
    """Send every request of `plan` (run, pinned version or None), CONCURRENCY at a time."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def one(run: str, version: int | None) -> httpx.Response:
            model = run if version is None else f"{run}@v{version}"
            async with gate:
                return await http.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                                 "max_tokens": MAX_TOKENS, "temperature": 0})

        return await asyncio.gather(*(one(run, version) for run, version in plan))


async def test_256_versions_through_8_slots_fail_no_request_and_serve_no_wrong_version(
    role_urls: dict[Role, str], redis_conn: redis.Redis, tmp_path: Path, tiny_model: Path, tokenizer: Any,
    engine_url: str,
) -> None:
    store = AdapterStore(tmp_path / "store")
    template = build_random_adapter(tiny_model, tmp_path / "template", rank=4, seed=0, target_modules=ATTENTION_QV)
    settings = inference_settings(role_urls[Role.INFERENCE], store.root, engine_url, tiny_model, limit=MAX_TOKENS)
    settings.engine.max_loaded_adapters = SLOTS
    with gateway(settings, tokenizer) as url:
        events = EventStream(redis_conn)
        manifests = publish_all(redis_conn, store, tiny_model, template)
        for m in manifests:  # hot-loaded from their adapter_ready, each newer one evicting older ones
            announce(events, store, m)
        runs = sorted({m.run for m in manifests})
        rng = random.Random(7)
        plan: list[tuple[str, int | None]] = [
            (rng.choice(runs), None if rng.random() < 0.2 else rng.randint(1, VERSIONS)) for _ in range(REQUESTS)]
        asked = {(run, VERSIONS if v is None else v) for run, v in plan}  # plain `run` means its newest version
        expected = await references(tiny_model, store, [m for m in manifests if (m.run, m.version) in asked])
        distinct = {(tuple(ids), tuple(round(lp, 3) for lp in lps)) for ids, lps in expected.values()}
        assert len(distinct) == len(expected), "two versions complete the prompt alike: the test could not tell them apart"

        def all_newest_served() -> bool:
            loaded = {(e.run, e.version) for e in events.history() if e.kind is EventKind.ADAPTER_LOADED}
            return all((run, VERSIONS) in loaded for run in runs)

        wait_until(all_newest_served, timeout_s=120, what="every run's newest version served")
        replies = await load(url, plan)

        failed = [(run, v, r.status_code, r.text[:200]) for (run, v), r in zip(plan, replies, strict=True)
                  if r.status_code != 200]
        assert failed == [], f"{len(failed)} of {REQUESTS} requests failed, e.g. {failed[:3]}"
        mismatched = []
        for (run, pinned), reply in zip(plan, replies, strict=True):
            version = VERSIONS if pinned is None else pinned
            answer = reply.json()["tandem"]
            if answer["version"] != version or reply.headers["x-tandem-version"] != str(version) \
                    or wrong(answer, expected[(run, version)]):
                mismatched.append((run, pinned, answer["version"]))
        assert mismatched == [], f"{len(mismatched)} of {REQUESTS} answers came from another version: {mismatched[:5]}"

        async with httpx.AsyncClient() as http:
            assert len(await TransformersEngine(http, engine_url).loaded_adapters()) <= SLOTS
        # every version asked for but the SLOTS held before needed a load: the slots did cycle (some
        # loads find room a reconcile's retirement freed, the others evict)
        assert metric(url, "tandem_adapter_on_demand_loads_total") >= len(asked) - SLOTS
        assert metric(url, "tandem_adapter_evictions_total") >= REQUESTS // 4
