"""The transformers engine serves adapters under any name a run may give them.

Run names may contain '.' (tandem.runs.RUN_NAME), so the controller loads versions under names
like `my.run-v1`; peft refuses '.' in its adapter names, so the engine holds each adapter in peft
under an internal name of its own, and everything outside it keeps using the public one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.loopback import serve_app

from tandem.settings import EngineSettings
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_trainer.tiny_model import build_random_adapter

pytestmark = pytest.mark.integration

KEY = "sesame"


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    build_random_adapter(tiny_model, root / "v1", seed=1)
    build_random_adapter(tiny_model, root / "v2", seed=2)
    return root


@pytest.fixture(scope="module")
def client(tiny_model: Path) -> Iterator[httpx.Client]:
    settings = EngineSettings(model=str(tiny_model), device="cpu", served_model_name="tiny",
                              max_lora_rank=16, max_loaded_adapters=4, admin_api_key=KEY)
    with serve_app(create_engine_app(settings)) as url, \
            httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def load(client: httpx.Client, name: str, path: Path) -> httpx.Response:
    return client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def unload(client: httpx.Client, name: str) -> httpx.Response:
    return client.post("/unload_lora_adapter", json={"lora_name": name})


def greedy(client: httpx.Client, lora: str | None = None) -> list[int]:
    body = {"text": "What is 2 plus 2?", "lora_path": lora,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["output_ids"]
    return ids


def test_an_adapter_named_with_a_dot_loads_serves_and_unloads(client: httpx.Client, adapters: Path) -> None:
    base = greedy(client)
    assert load(client, "plain-v1", adapters / "v1").status_code == 200
    expected = greedy(client, "plain-v1")
    assert expected != base
    assert unload(client, "plain-v1").status_code == 200

    loaded = load(client, "my.run-v1", adapters / "v1")
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["loaded_adapters"] == {"my.run-v1": str(adapters / "v1")}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "my.run-v1"]
    assert greedy(client, "my.run-v1") == expected
    body = {"model": "tiny:my.run-v1", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "n": 2, "ignore_eos": True}
    chat = client.post("/v1/chat/completions", json=body)
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2, chat.text
    assert greedy(client) == base  # the base model is untouched

    assert unload(client, "my.run-v1").status_code == 200
    assert client.get("/server_info").json()["loaded_adapters"] == {}
    gone = client.post("/generate", json={"text": "hi", "lora_path": "my.run-v1"})
    assert gone.status_code == 400 and "my.run-v1" in gone.text
    assert greedy(client) == base


def test_names_that_differ_only_in_dot_or_underscore_stay_apart(client: httpx.Client, adapters: Path) -> None:
    assert load(client, "a_b-v1", adapters / "v1").status_code == 200
    one = greedy(client, "a_b-v1")
    assert load(client, "a.b-v1", adapters / "v2").status_code == 200, "a.b-v1 was taken for a_b-v1"
    two = greedy(client, "a.b-v1")
    assert one != two and greedy(client, "a_b-v1") == one

    assert unload(client, "a_b-v1").status_code == 200
    assert greedy(client, "a.b-v1") == two  # the other one is still served
    assert load(client, "a_b-v1", adapters / "v1").status_code == 200  # and a name can come back
    assert greedy(client, "a_b-v1") == one
    for name in ("a.b-v1", "a_b-v1"):
        assert unload(client, name).status_code == 200
    assert client.get("/server_info").json()["loaded_adapters"] == {}
