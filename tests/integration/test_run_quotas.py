"""Each run's quotas on the inference side: its rollouts in flight at the gateway
(gateway/run_quota.py: work beyond it waits for its run's turn instead of failing, another run's
requests are not held behind it, a wait past its limit is a clear 429 that names the quota and the
setting), and its adapters in the engine (controller/slots.py: a run never holds more than its
slots, its own least recently used version is evicted first, another run's adapters stay).

The real gateway with its controller, the real transformers engine on the tiny model and a real
Redis; between the gateway and the engine a loopback proxy (helpers/gate_proxy.py) counts each
run's samples in flight at the engine and holds one run's calls until the test lets them go, so
the test looks at a burst while it is certainly still running.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.adapters import announce, publish
from helpers.gate_proxy import Gate, gate_proxy
from helpers.servers import gateway, inference_settings
from helpers.waiting import wait_until

from tandem.acl import Role
from tandem.adapters import AdapterStore
from tandem.dev.metrics import metric
from tandem.events import EventStream
from tandem.registry import Registry
from tandem.runs import RunSpec

pytestmark = pytest.mark.integration

QUOTA = 2
BURST = 10
MAX_TOKENS = 3


@pytest.fixture
def gate(engine_url: str) -> Iterator[Gate]:
    with gate_proxy(engine_url) as g:
        yield g


def start_gateway(stack: ExitStack, role_urls: dict[Role, str], tmp_path: Path, gate: Gate,
                  tiny_model: Path, tokenizer: Any, controller: dict[str, Any] | None = None,
                  **quota: Any) -> tuple[str, AdapterStore]:
    settings = inference_settings(role_urls[Role.INFERENCE], tmp_path / "store", gate.url, tiny_model,
                                  limit=MAX_TOKENS, **quota)
    settings.controller = settings.controller.model_copy(update=controller or {})
    return stack.enter_context(gateway(settings, tokenizer)), AdapterStore(settings.store.root)


def serve(url: str, store: AdapterStore, conns: dict[Role, redis.Redis], tiny_model: Path, *runs: str,
          versions: int = 1) -> None:
    """Create each run and publish its versions (as the trainer does); wait until each serves its newest."""
    for run in runs:
        Registry(conns[Role.CLIENT]).create_run(RunSpec(name=run, base_model=str(tiny_model)))
        for version in range(1, versions + 1):
            announce(EventStream(conns[Role.TRAINER]), store,
                     publish(store, Registry(conns[Role.TRAINER]), tiny_model, run, version))
    for run in runs:
        wait_until(lambda r=run: httpx.get(f"{url}/v1/runs/{r}").json()["serving_version"] == versions,
                   what=f"{run} v{versions} serving")


def burst(url: str, run: str, count: int) -> tuple[threading.Thread, list[httpx.Response]]:
    """`count` completions of `run` sent at once from a thread; their answers are appended as they come."""
    answers: list[httpx.Response] = []

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": run, "prompt": "1 2", "max_tokens": MAX_TOKENS, "temperature": 0}
            answers.extend(await asyncio.gather(*(http.post(f"{url}/v1/completions", json=body)
                                                  for _ in range(count))))

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    return thread, answers


def test_a_runs_burst_waits_for_its_turn_and_another_run_proceeds(
    gate: Gate, role_urls: dict[Role, str], role_conns: dict[Role, redis.Redis], tmp_path: Path, tiny_model: Path,
    tokenizer: Any,
) -> None:
    with ExitStack() as stack:
        url, store = start_gateway(stack, role_urls, tmp_path, gate, tiny_model, tokenizer,
                                   run_max_in_flight_sequences=QUOTA)
        serve(url, store, role_conns, tiny_model, "bursty", "steady")
        gate.held_runs.add("bursty")
        thread, answers = burst(url, "bursty", BURST)
        # the run's quota reaches the engine; the rest of its burst waits for its turn at the gateway
        wait_until(lambda: gate.in_flight["bursty"] == QUOTA, what="bursty at its quota at the engine")
        wait_until(lambda: metric(url, "tandem_gateway_run_queued_requests") == BURST - QUOTA,
                   what="the rest of the burst waiting for its run's turn")
        # while the burst is held, the other run's requests go through, every one
        for _ in range(3):
            other = httpx.post(f"{url}/v1/completions", json={"model": "steady", "prompt": "3", "max_tokens": 2},
                               timeout=60)
            assert other.status_code == 200, other.text
            assert other.headers["x-tandem-run"] == "steady"
        assert gate.served["steady"] == 3 and gate.in_flight["bursty"] == QUOTA and not answers
        gate.release.set()
        thread.join(120)
    assert not thread.is_alive() and len(answers) == BURST
    assert [a.status_code for a in answers] == [200] * BURST, [a.text for a in answers if a.status_code != 200]
    assert gate.peak["bursty"] == QUOTA  # never more than its quota at the engine at once
    assert gate.served["bursty"] == BURST


def test_a_wait_past_its_limit_is_a_429_that_names_the_quota_and_the_setting(
    gate: Gate, role_urls: dict[Role, str], role_conns: dict[Role, redis.Redis], tmp_path: Path, tiny_model: Path,
    tokenizer: Any,
) -> None:
    with ExitStack() as stack:
        url, store = start_gateway(stack, role_urls, tmp_path, gate, tiny_model, tokenizer,
                                   run_max_in_flight_sequences=1, run_queue_timeout_s=0.5, retry_after_s=4)
        serve(url, store, role_conns, tiny_model, "slow")
        gate.held_runs.add("slow")
        first, first_answers = burst(url, "slow", 1)
        wait_until(lambda: gate.in_flight["slow"] == 1, what="the first request at the engine")
        waiting, waited = burst(url, "slow", 1)  # waits for its run's turn, which does not come in time
        waiting.join(60)
        (timed_out,) = waited
        assert timed_out.status_code == 429 and timed_out.headers["retry-after"] == "4"
        error = timed_out.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["reason"] == "run_quota_timeout"
        assert "gateway.run_max_in_flight_sequences=1" in error["message"]
        assert "gateway.run_queue_timeout_s" in error["message"] and "'slow'" in error["message"]
        gate.release.set()
        first.join(60)
        assert [a.status_code for a in first_answers] == [200]
        assert metric(url, "tandem_gateway_refused_total", reason="run_quota_timeout") == 1
        assert gate.peak["slow"] == 1


def test_a_run_never_holds_more_than_its_engine_slots_and_evicts_its_own_versions_first(
    gate: Gate, role_urls: dict[Role, str], role_conns: dict[Role, redis.Redis], tmp_path: Path, tiny_model: Path,
    tokenizer: Any,
) -> None:
    """Six versions of one run asked for in random order, a few at a time, through an engine with
    room for many: the run takes at most its 2 slots, every request is answered by the version it
    asked for, and the other run's adapter is never unloaded."""
    with ExitStack() as stack:
        url, store = start_gateway(stack, role_urls, tmp_path, gate, tiny_model, tokenizer,
                                   controller={"run_max_loaded_adapters": 2, "keep_versions": 2})
        serve(url, store, role_conns, tiny_model, "other")
        serve(url, store, role_conns, tiny_model, "many", versions=6)
        rng = random.Random(7)
        asked = [rng.choice([*(f"many@v{v}" for v in range(1, 7)), "other"]) for _ in range(36)]

        async def main() -> list[httpx.Response]:
            limit = asyncio.Semaphore(4)
            async with httpx.AsyncClient(timeout=120) as http:
                async def one(model: str) -> httpx.Response:
                    async with limit:
                        return await http.post(f"{url}/v1/completions", json={
                            "model": model, "prompt": "1 2", "max_tokens": MAX_TOKENS, "temperature": 0})
                return list(await asyncio.gather(*(one(m) for m in asked)))

        answers = asyncio.run(main())
    assert [a.status_code for a in answers] == [200] * len(asked), [a.text for a in answers if a.status_code != 200]
    for model, answer in zip(asked, answers, strict=True):
        run, _, version = model.partition("@v")
        assert answer.headers["x-tandem-run"] == run
        assert answer.headers["x-tandem-version"] == (version or "1")
    assert gate.peak_adapters["many"] == 2  # at its quota, never past it
    assert sum(name.startswith("many-v") for name in gate.unloaded) >= 4  # its versions took turns
    assert not [name for name in gate.unloaded if name.startswith("other-v")]  # the other run's stayed
