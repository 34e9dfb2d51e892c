"""On a GPU with SGLang or vLLM: mixed-adapter batches and logprobs, with the launch flags tandem ships.

bench/gpu/gpu_mixed.py's checks as a test, on the engine started with tandem's own command line
(SGLang: `sglang_argv`, the shipped `engine.lora_backend`, CUDA graphs on; vLLM: `vllm_argv`,
`--logprobs-mode processed_logprobs`, `--generation-config vllm`, CUDA graphs on) and driven
through its `Engine` client, as the gateway drives it: no request of a batch that mixes adapters
(or the base model) departs from its solo output where that output's best token led the
runner-up by more than a tie (`gpu_mixed.TIE_NATS`): a kernel that skips some adapters' LoRA work
(sglang#28371) does that at once; departures at ties are bfloat16 batching noise, which the
single-adapter control shows as well. And the trainer's logprobs of tokens the
engine sampled at T 0.7 and 1.0 with top_p 1 (tandem's convention) stay within bfloat16's noise
(`AGREEMENT`), which the same tokens read as the unscaled model (the convention tandem had
before) break. (With top_p 0.9 vLLM's processed logprobs are renormalised over the nucleus,
engines/vllm_launcher.py: those rows are reported by the bench, not held to the bound here.)

Needs TANDEM_TEST_SGLANG_PYTHON / TANDEM_TEST_VLLM_PYTHON: an interpreter whose environment has
the engine (the images' /opt/sglang/bin/python, /opt/vllm/bin/python, or a wrapper that puts
the engine's folder on PYTHONPATH). TANDEM_TEST_ENGINE_SETTINGS, a JSON object of engine
settings, checks another configuration than the shipped one: '{"prefill_graphs_from_one_token": false}'.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from helpers.bench import bench_module

pytestmark = [pytest.mark.integration, pytest.mark.gpu, pytest.mark.slow]

PYTHONS = {"sglang": "TANDEM_TEST_SGLANG_PYTHON", "vllm": "TANDEM_TEST_VLLM_PYTHON"}
PORTS = {"sglang": 30177, "vllm": 30178}

AGREEMENT: dict[str, float] = bench_module("scenarios.agreement").BF16_AGREEMENT
"""Engine against trainer in bfloat16 at T >= 0.7: bounds on the per-token mean, maximum and share
of |Δ logprob| above 0.1 nats, calibrated on H100s (bench/scenarios/agreement.py says how); the bench's
agreement scenario holds the same bound."""


def within_noise(row: dict[str, Any]) -> bool:
    return all(float(row[key]) <= bound for key, bound in AGREEMENT.items())


@pytest.mark.parametrize("engine", sorted(PYTHONS))
def test_mixed_batches_and_logprobs_agree_with_solo_and_the_trainer(engine: str, tmp_path: Path) -> None:
    python = os.environ.get(PYTHONS[engine])
    if not python:
        pytest.skip(f"{PYTHONS[engine]} (an interpreter with {engine}) is not set")
    from tandem_trainer.tiny_model import build_random_adapter, build_tiny_model

    mixed = bench_module("gpu.gpu_mixed")
    shape = {**bench_module("benchlib").SHAPES["0.5b"], "initializer_range": 0.02}
    model = build_tiny_model(tmp_path / "model", **shape)
    adapters = {name: build_random_adapter(model, tmp_path / name, rank=16, seed=i + 1, scale=0.02)
                for i, name in enumerate(mixed.ADAPTERS)}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 24))] for _ in range(4)]
    fields = json.loads(os.environ.get("TANDEM_TEST_ENGINE_SETTINGS") or "{}")
    result = mixed.serve_and_check(model, adapters, prompts, backend=None, engine_kind=engine,
                                   **{f"{engine}_python": python}, port=PORTS[engine], out=tmp_path,
                                   engine_fields=fields)
    for r in result["mixed"]["rows"]:  # shown by `pytest -rP`: the table of docs/benchmarks.md
        print(f"{engine} | {r['batch']} | {r['attempt']} | {r['exact']}/{r['requests']} | "
              f"wrong from step 1: {r['wrong_from_first_decode_step']} | beyond a tie: {r['departed_beyond_ties']}")
    if engine == "vllm":
        assert "--logprobs-mode" in result["argv"]
    assert result["mixed"]["distinct_solo_outputs"] == 5, "the adapters must decode apart for the check to mean anything"
    beyond_ties = [r for r in result["mixed"]["rows"] if r["departed_beyond_ties"]]
    assert beyond_ties == []
    rows = mixed.agreement(model, adapters["A"], result["samples"], tmp_path / "trainer")
    ours = [r for r in rows if r["trainer_convention"].startswith("scaled") and r["temperature"] >= 0.7
            and (engine == "sglang" or r["top_p"] == 1.0)]
    for r in rows:
        print(f"{engine} | {r['adapter']} T={r['temperature']} top_p={r['top_p']} {r['trainer_convention']}: "
              f"mean {r['mean_abs']:.2e} max {r['max_abs']:.2e} >0.1 {r['over_outlier']:.4f} ratio {r['ratio_mean']:.4f}")
    assert ours and all(within_noise(r) for r in ours), ours
    before = [r for r in rows if r["trainer_convention"].startswith("unscaled") and r["temperature"] >= 0.7]
    assert before and not any(within_noise(r) for r in before), "the bound must catch the unscaled convention"
    assert all(abs(r["ratio_mean"] - 1) < 0.02 for r in ours), ours
