"""`/update_weights_from_disk` on the transformers engine, over HTTP, with real forward passes."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers.loopback import serve_app

from tandem.settings import EngineSettings
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_trainer.tiny_model import build_random_adapter

pytestmark = pytest.mark.integration

KEY = "sesame"


@pytest.fixture(scope="module")
def checkpoints(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints beside the tiny model: other values, a merged adapter, and mismatched ones."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("checkpoints")
    gen = torch.Generator().manual_seed(3)

    other = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.2)
    other.save_pretrained(root / "other")

    adapter = build_random_adapter(tiny_model, root / "adapter", seed=3)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), adapter)
    tuned.merge_and_unload().save_pretrained(root / "merged")

    config = AutoConfig.from_pretrained(tiny_model)
    config.intermediate_size *= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "wider")

    shutil.copytree(tiny_model, root / "cut")
    tensors = load_file(root / "cut" / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, root / "cut" / "model.safetensors", metadata={"format": "pt"})

    shutil.copytree(tiny_model, root / "scalar")
    (root / "scalar" / "config.json").write_text("7")
    return {"base": tiny_model, **{p.name: p for p in root.iterdir()}}


@pytest.fixture(scope="module")
def url(tiny_model: Path) -> Iterator[str]:
    settings = EngineSettings(model=str(tiny_model), device="cpu", served_model_name="tiny", max_lora_rank=16,
                              admin_api_key=KEY)
    with serve_app(create_engine_app(settings)) as base_url:
        yield base_url


@pytest.fixture
def client(url: str, tiny_model: Path) -> Iterator[httpx.Client]:
    """An admin client; the original weights are back and every adapter unloaded after each test."""
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c
        assert reload(c, tiny_model).status_code == 200
        for name in c.get("/server_info").json()["loaded_adapters"]:
            assert c.post("/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def reload(client: httpx.Client, path: Path | str, **extra) -> httpx.Response:
    return client.post("/update_weights_from_disk", json={"model_path": str(path), **extra})


def greedy(client: httpx.Client, lora: str | None = None, tokens: int = 10) -> tuple[list[int], list[float]]:
    body = {"text": "What is 2 plus 2?", "lora_path": lora, "return_logprob": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def test_reload_changes_the_served_weights_in_place_and_back(client: httpx.Client, checkpoints: dict[str, Path]) -> None:
    before = greedy(client)
    response = reload(client, checkpoints["other"], weight_version="step-7")
    assert response.status_code == 200
    assert response.json() == {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
    after = greedy(client)
    assert after != before
    info = client.get("/server_info").json()
    assert info["model_path"] == str(checkpoints["other"])
    meta = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert meta["weight_version"] == "step-7"

    assert reload(client, checkpoints["base"]).status_code == 200
    assert greedy(client) == before  # the same values copied back: the same outputs, bit for bit


def test_merged_adapter_as_base_answers_like_the_adapter(client: httpx.Client, checkpoints: dict[str, Path]) -> None:
    load = client.post("/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(checkpoints["adapter"])})
    assert load.status_code == 200, load.text
    base_ids, _ = greedy(client)
    tuned_ids, tuned_lps = greedy(client, "tuned")
    assert tuned_ids != base_ids

    assert reload(client, checkpoints["merged"]).status_code == 200  # with an adapter loaded (peft-wrapped)
    merged_ids, merged_lps = greedy(client)
    assert merged_ids == tuned_ids
    assert max(abs(a - b) for a, b in zip(merged_lps, tuned_lps, strict=True)) < 1e-4
    assert client.get("/server_info").json()["loaded_adapters"] == {"tuned": str(checkpoints["adapter"])}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("missing", "not a local directory"),
        ("adapter", "no config.json"),
        ("wider", "intermediate_size=256"),
        ("cut", "tensor 'model.layers.0.mlp.up_proj.weight' has shape (127, 64), the serving model's has (128, 64)"),
        ("scalar", "config.json is not a JSON object"),
    ],
)
def test_refused_checkpoints_get_400_naming_the_problem_and_the_old_weights_serve(
    client: httpx.Client, checkpoints: dict[str, Path], name: str, expected: str
) -> None:
    before = greedy(client)
    path = checkpoints.get(name, checkpoints["base"].parent / "no-such-model")
    response = reload(client, path)
    assert response.status_code == 400
    body = response.json()
    assert body["success"] is False and expected in body["message"] and str(path) in body["message"]
    assert greedy(client) == before
    assert client.get("/server_info").json()["model_path"] == str(checkpoints["base"])


def test_reload_is_an_admin_route_and_refuses_other_formats(url: str, client: httpx.Client, checkpoints: dict[str, Path]) -> None:
    response = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(checkpoints["other"])})
    assert response.status_code == 401
    response = reload(client, checkpoints["other"], load_format="gguf")
    assert response.status_code == 400 and "load_format='gguf'" in response.json()["message"]


def test_abort_all_requests_ends_running_generations(url: str, client: httpx.Client, checkpoints: dict[str, Path]) -> None:
    started = threading.Event()
    finish: list[str | None] = []

    def stream() -> None:
        body = {"text": "Count.", "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    finish.append((json.loads(line[6:])["meta_info"]["finish_reason"] or {}).get("type"))

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(60)
    assert reload(client, checkpoints["other"], abort_all_requests=True).status_code == 200
    worker.join(60)
    assert finish[-1] == "abort" and len(finish) < 900
