"""The transformers engine's admin routes: who may call them, and which paths they may read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.loopback import serve_app

from tandem.settings import EngineSettings, InferenceSettings, StoreSettings
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_trainer.tiny_model import build_random_adapter

pytestmark = pytest.mark.integration

KEY = "sesame"


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real adapter of the tiny model, outside any root the engines below allow."""
    return build_random_adapter(tiny_model, tmp_path_factory.mktemp("elsewhere") / "adapter", rank=4)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("roots")
    (base / "adapters").mkdir()
    (base / "models").mkdir()
    return base / "adapters", base / "models"


@pytest.fixture(scope="module")
def client(tiny_model: Path, roots: tuple[Path, Path]) -> Iterator[httpx.Client]:
    adapters, models = roots
    settings = EngineSettings(model=str(tiny_model), device="cpu", admin_api_key=KEY,
                              adapter_roots=[adapters], weights_roots=[models])
    with serve_app(create_engine_app(settings)) as url, \
            httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_an_adapter_outside_the_roots_is_refused_with_both_named(client: httpx.Client, adapter: Path,
                                                                 roots: tuple[Path, Path]) -> None:
    r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)})
    assert r.status_code == 400, r.text
    message = r.json()["error_message"]
    assert str(adapter) in message and str(roots[0]) in message
    assert client.get("/server_info").json()["loaded_adapters"] == {}


def test_a_symlink_in_the_root_that_leaves_it_is_refused(client: httpx.Client, adapter: Path,
                                                         roots: tuple[Path, Path]) -> None:
    link = roots[0] / "link"
    link.symlink_to(adapter)
    r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(link)})
    assert r.status_code == 400 and str(link) in r.json()["error_message"], r.text

    inside = roots[0] / "inside"  # a directory in the root whose weights file leaves it
    inside.mkdir()
    (inside / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    (inside / "adapter_model.safetensors").symlink_to(adapter / "adapter_model.safetensors")
    r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(inside)})
    assert r.status_code == 400 and "adapter_model.safetensors" in r.json()["error_message"], r.text


def test_an_adapter_inside_the_root_loads(client: httpx.Client, adapter: Path, roots: tuple[Path, Path]) -> None:
    import shutil

    copy = roots[0] / "run" / "v000001"
    shutil.copytree(adapter, copy)
    r = client.post("/load_lora_adapter", json={"lora_name": "run-v1", "lora_path": str(copy)})
    assert r.status_code == 200, r.text
    assert client.post("/unload_lora_adapter", json={"lora_name": "run-v1"}).status_code == 200


def test_weights_outside_the_roots_are_refused(client: httpx.Client, tiny_model: Path,
                                               roots: tuple[Path, Path]) -> None:
    r = client.post("/update_weights_from_disk", json={"model_path": str(tiny_model)})
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert str(tiny_model) in message and str(roots[1]) in message


@pytest.mark.parametrize(("route", "field", "message"), [
    ("/load_lora_adapter", "lora_path", "error_message"),
    ("/update_weights_from_disk", "model_path", "message"),
])
def test_a_path_with_a_nul_byte_is_refused_and_the_engine_keeps_answering(
        client: httpx.Client, roots: tuple[Path, Path], route: str, field: str, message: str) -> None:
    bad = f"{roots[0]}/run\u0000/v000001"
    r = client.post(route, json={"lora_name": "a", field: bad})
    assert r.status_code == 400, r.text
    assert field in r.json()[message] and repr(bad) in r.json()[message]
    assert client.get("/health").status_code == 200


def test_a_symlink_loop_in_the_root_is_refused(client: httpx.Client, roots: tuple[Path, Path]) -> None:
    looped = roots[0] / "looped"
    looped.mkdir()
    (looped / "adapter_model.safetensors").symlink_to("adapter_model.safetensors")
    for path in (looped, looped / "adapter_model.safetensors"):
        r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(path)})
        assert r.status_code == 400 and str(path) in r.json()["error_message"], r.text
    assert client.get("/health").status_code == 200


async def test_without_a_key_admin_routes_answer_loopback_only(tiny_model: Path) -> None:
    app = create_engine_app(EngineSettings(model=str(tiny_model), device="cpu"))
    body = {"lora_name": "a", "lora_path": "/x"}
    remote = httpx.AsyncClient(transport=httpx.ASGITransport(app, client=("10.1.2.3", 40000)), base_url="http://e")
    async with remote:
        r = await remote.post("/load_lora_adapter", json=body)
        assert r.status_code == 403 and "TANDEM_ENGINE__ADMIN_API_KEY" in r.text, r.text
        assert (await remote.post("/release_memory_occupation")).status_code == 403
        assert (await remote.get("/health")).status_code == 503  # not an admin route: no 403
    local = httpx.AsyncClient(transport=httpx.ASGITransport(app, client=("127.0.0.1", 40000)), base_url="http://e")
    async with local:  # past the admin check; the model is not loaded here (no lifespan)
        assert (await local.post("/load_lora_adapter", json=body)).status_code == 503


def test_the_service_settings_confine_the_engine_by_default(tmp_path: Path) -> None:
    model = tmp_path / "models" / "base"
    model.mkdir(parents=True)
    settings = InferenceSettings(store=StoreSettings(root=tmp_path / "adapters"),
                                 engine=EngineSettings(model=str(model)))
    assert settings.engine.adapter_roots == [tmp_path / "adapters"]
    assert settings.engine.weights_roots == [(tmp_path / "models").resolve()]
    hub = InferenceSettings(engine=EngineSettings(model="Qwen/Qwen2.5-0.5B-Instruct"))
    assert hub.engine.weights_roots == []
