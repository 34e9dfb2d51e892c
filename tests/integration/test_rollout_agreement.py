"""Rollouts you can trust, on the transformers engine: what the gateway serves is what training assumes.

- Rollout/trainer agreement: completions sampled through the gateway (tandem.Client, a trained
  version hot-loaded by the controller) at temperatures 0.3, 0.7 and 1.0, with and without
  top_p 0.9, are recomputed by the trainer's own backend on the same version; the first epoch's
  importance ratio is 1 up to float error. Recomputed in the other logprob convention (the
  unscaled model), the same tokens miss by far more: the check tells the conventions apart.
- Batch invariance across adapters: greedy outputs of requests fired together over several
  adapters (and the base model) equal each request's output alone, token for token.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.adapters import announce, publish
from helpers.loopback import serve_app
from helpers.servers import BASE, gateway, inference_settings
from helpers.waiting import wait_until

from tandem import Client
from tandem.adapters import AdapterStore
from tandem.events import EventStream
from tandem.logprobs import Mismatch
from tandem.registry import Registry
from tandem.runs import LoraConfig, OptimizerConfig, RunSpec
from tandem.settings import EngineSettings, InferenceSettings, TrainerSettings
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_trainer.backends.peft import PeftBackend
from tandem_trainer.jobs.runner import Trainer
from tandem_trainer.logprob_check import recompute

pytestmark = pytest.mark.integration

CHAT = [{"role": "system", "content": "You count."}, {"role": "user", "content": "Count from 3 to 9."}]
PROMPTS = ["Count from 3 to 9.", "What is 2 plus 2?", "Name a colour.", "Say hello."]


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    settings = EngineSettings(model=str(tiny_model), device="cpu", max_lora_rank=16, max_loaded_adapters=16)
    with serve_app(create_engine_app(settings)) as url:
        yield url


@pytest.fixture
def settings(redis_url: str, tmp_path: Path, engine_url: str, tiny_model: Path) -> InferenceSettings:
    return inference_settings(redis_url, tmp_path / "store", engine_url, tiny_model, limit=64)


@pytest.fixture
def url(settings: InferenceSettings, tokenizer: Any, redis_conn: redis.Redis) -> Iterator[str]:
    with gateway(settings, tokenizer) as u:
        yield u


def made_up_job(run: str, seed: int = 0) -> dict[str, Any]:
    """A valid job of made-up tokens: enough to move the adapter away from its fresh init."""
    rng = random.Random(seed)
    groups = []
    for _ in range(2):
        prompt = [rng.randrange(3, 500) for _ in range(6)]
        trajectories = [{"prompt_ids": prompt, "completion_ids": [rng.randrange(3, 500) for _ in range(8)],
                         "rollout_logprobs": [-6.2] * 8, "reward": float(i), "version": 0} for i in range(4)]
        groups.append({"trajectories": trajectories})
    return {"job_id": f"{run}-1", "run": run, "step": 1, "groups": groups, "timeout_s": 60}


@pytest.mark.slow
def test_the_first_epoch_ratio_is_one_at_every_temperature(
    url: str, settings: InferenceSettings, redis_url: str, redis_conn: redis.Redis, tiny_model: Path
) -> None:
    spec = Registry(redis_conn).create_run(RunSpec(
        name="agree", base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0),
        optimizer=OptimizerConfig(lr=5e-2)))
    store = AdapterStore(settings.store.root)
    backend = PeftBackend("cpu")
    trainer_settings = TrainerSettings(redis={"url": redis_url}, store={"root": settings.store.root},
                                       backend={"micro_batch_tokens": 256})
    assert Trainer(trainer_settings, redis_conn, backend, store).train(made_up_job(spec.name)).version == 1
    wait_until(lambda: httpx.get(f"{url}/v1/runs/{spec.name}").json()["serving_version"] == 1,
               what="v1 serving", timeout_s=60)

    with Client(url, redis_url) as client:
        agreement_at_every_temperature(client.run(spec.name), backend, spec, store)


def agreement_at_every_temperature(run: Any, backend: PeftBackend, spec: RunSpec, store: AdapterStore) -> None:
    for temperature in (0.3, 0.7, 1.0):
        for top_p in (1.0, 0.9):
            completions = run.chat(CHAT, n=4, max_tokens=24, temperature=temperature, top_p=top_p)
            assert {c.version for c in completions} == {1}
            assert {c.temperature for c in completions} == {temperature}
            trainer = recompute(backend, spec, 1, store.version_dir(spec.name, 1), completions)
            agreement = Mismatch.of([c.rollout_logprobs for c in completions], trainer)
            assert agreement.tokens == sum(len(c.completion_ids) for c in completions) > 0
            assert agreement.max_abs < 2e-4, (temperature, top_p, agreement)
            assert abs(agreement.ratio_mean - 1) < 1e-4, (temperature, top_p, agreement)
            if temperature != 1.0:  # the unscaled model's logprobs of the same tokens: far off
                other = Mismatch.of([c.rollout_logprobs for c in completions],
                                    recompute(backend, spec, 1, store.version_dir(spec.name, 1), completions,
                                              temperature=1.0))
                assert other.max_abs > 0.1 and other.over_outlier > 0.05, (temperature, other)


def test_greedy_samples_carry_the_logprobs_of_temperature_one(url: str, redis_url: str,
                                                                            redis_conn: redis.Redis,
                                                                            tiny_model: Path) -> None:
    """Greedy samples carry the logprobs of temperature 1 (the convention's rule for T = 0)."""
    spec = Registry(redis_conn).create_run(RunSpec(name="greedy", base_model=str(tiny_model)))
    with Client(url, redis_url) as client:
        run = client.run(spec.name)
        first, again = (run.chat(CHAT, max_tokens=12, temperature=0)[0] for _ in range(2))
        assert first.completion_ids == again.completion_ids and first.temperature == 1.0
        assert run.chat(CHAT, max_tokens=12, temperature=0.5)[0].temperature == 0.5


# batch invariance ------------------------------------------------------------------------------
def greedy(url: str, model: str, prompt: str) -> list[int]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["tandem"]["completion_token_ids"][0])


def together(url: str, requests: list[tuple[str, str]]) -> list[list[int]]:
    """Every (model, prompt) fired at once, so that the engine holds them in one batch if it can."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: greedy(url, *r), requests))


@pytest.mark.slow
def test_mixed_adapter_batches_decode_every_request_as_it_decodes_alone(
    url: str, settings: InferenceSettings, redis_conn: redis.Redis, tiny_model: Path
) -> None:
    store, registry, events = AdapterStore(settings.store.root), Registry(redis_conn), EventStream(redis_conn)
    runs = ["mixa", "mixb", "mixc", "mixd"]
    for name in runs:
        registry.create_run(RunSpec(name=name, base_model=str(tiny_model)))
    for rank, name in zip((4, 8, 12, 16), runs, strict=True):  # v1 of each: distinct random adapters
        announce(events, store, publish(store, registry, tiny_model, name, 1, rank=rank))
    # the swap pair: "mixa" at v1 and v2 (a pinned request keeps the older version serving)
    announce(events, store, publish(store, registry, tiny_model, "mixa", 2, rank=4))
    wait_until(lambda: [httpx.get(f"{url}/v1/runs/{n}").json()["serving_version"] for n in runs] == [2, 1, 1, 1],
               what="every adapter serving")
    models = [BASE, "mixa@v1", "mixa@v2", "mixb@v1", "mixc@v1", "mixd@v1"]
    solo = {(m, p): greedy(url, m, p) for m in models for p in PROMPTS}
    assert len({tuple(solo[m, PROMPTS[0]]) for m in models}) == len(models), "the adapters must decode apart"

    batches = {
        "two adapters": [(m, p) for m in ("mixb@v1", "mixc@v1") for p in PROMPTS],
        "four adapters and base": [(m, PROMPTS[0]) for m in (BASE, "mixa@v2", "mixb@v1", "mixc@v1", "mixd@v1")],
        "32 requests over five": [(m, p) for m in models[:1] + models[2:] for p in PROMPTS * 2][:32],
        "version swap": [("mixa@v1", PROMPTS[1]), ("mixa@v2", PROMPTS[1])],
    }
    for what, batch in batches.items():
        got = together(url, batch)
        wrong = [r for r, ids in zip(batch, got, strict=True) if ids != solo[r]]
        assert not wrong, f"{what}: {len(wrong)} of {len(batch)} differ from their solo output: {wrong}"
