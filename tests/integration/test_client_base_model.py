"""`Client.create_run` refuses a run whose base model is not the one the engine serves, or whose
adapters the engine would refuse to load (a rank above its limit, modules SGLang prepares no LoRA for).

A real gateway on loopback tells its engine's model in `/v1/models`; no engine is needed for that.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.loopback import free_port
from helpers.servers import gateway, inference_settings

from tandem import Client, LoraConfig
from tandem.errors import BackendUnavailable, ValidationFailed
from tandem.runs import DEFAULT_TARGETS
from tandem.settings import InferenceSettings

pytestmark = pytest.mark.integration

ENGINE_MODEL = "/models/Qwen/Qwen2.5-0.5B-Instruct"


def settings_for(redis_url: str, tmp_path: Path, model: str) -> InferenceSettings:
    return inference_settings(redis_url, tmp_path / "store", f"http://127.0.0.1:{free_port()}", Path(model))


@pytest.fixture
def gateway_url(redis_url: str, tmp_path: Path, tokenizer: Any) -> Iterator[str]:
    with gateway(settings_for(redis_url, tmp_path, ENGINE_MODEL), tokenizer, with_controller=False) as url:
        yield url


def test_a_run_on_another_model_is_refused_naming_both(gateway_url: str, redis_conn: redis.Redis) -> None:
    client = Client(gateway_url, conn=redis_conn)
    with pytest.raises(ValidationFailed) as info:
        client.create_run("wrong", base_model="Qwen/Qwen2.5-7B-Instruct")
    message = str(info.value)
    assert "Qwen/Qwen2.5-7B-Instruct" in message and ENGINE_MODEL in message and info.value.field == "base_model"
    assert client.runs() == []  # nothing registered
    client.close()


def test_a_run_named_as_the_engine_serves_its_base_model_is_refused(
    gateway_url: str, redis_conn: redis.Redis
) -> None:
    # model="base" reaches the base model: a run named so would never sample from its own adapters
    client = Client(gateway_url, conn=redis_conn)
    served = next(c for c in client.get("/v1/models")["data"] if c.get("root"))["id"]
    with pytest.raises(ValidationFailed) as info:
        client.create_run(served, base_model=ENGINE_MODEL)
    assert info.value.field == "name" and f"run name {served!r}" in str(info.value)
    assert "choose another run name" in str(info.value)
    assert client.runs() == []
    client.close()


@pytest.mark.parametrize("base_model", [
    ENGINE_MODEL,
    ENGINE_MODEL + "/",  # the same path, written differently
    "Qwen/Qwen2.5-0.5B-Instruct",  # the hub id the engine's local copy was made from
    "base",  # the engine's served name
])
def test_the_engine_model_in_any_comparable_form_is_accepted(
    gateway_url: str, redis_conn: redis.Redis, base_model: str
) -> None:
    client = Client(gateway_url, conn=redis_conn)
    run = client.create_run("right", base_model=base_model)
    # the served name is a name, not a model the trainer can load: the run records the model itself
    assert run.spec.base_model == (ENGINE_MODEL if base_model == "base" else base_model)
    assert client.registry.get_run("right").base_model == run.spec.base_model and client.runs() == ["right"]
    client.close()


def test_a_local_path_is_compared_by_where_it_leads(redis_url: str, redis_conn: redis.Redis, tmp_path: Path,
                                                    tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (tmp_path / "link").symlink_to(model)
    with gateway(settings_for(redis_url, tmp_path, str(model)), tokenizer, with_controller=False) as url:
        client = Client(url, conn=redis_conn)
        monkeypatch.chdir(tmp_path)
        assert client.create_run("rel", base_model="models/tiny").spec.base_model == "models/tiny"
        assert client.create_run("link", base_model=str(tmp_path / "link")).name == "link"
        with pytest.raises(ValidationFailed):
            client.create_run("other", base_model=str(tmp_path / "models" / "small"))
        client.close()


def test_no_gateway_is_backend_unavailable_naming_it(redis_conn: redis.Redis) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    client = Client(url, conn=redis_conn)
    with pytest.raises(BackendUnavailable, match=url):
        client.create_run("r", base_model="tiny")
    client.close()


def test_the_gateway_tells_its_model_and_runs_while_redis_is_down(tmp_path: Path, tokenizer: Any) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with gateway(settings_for(dead, tmp_path, ENGINE_MODEL), tokenizer, with_controller=False) as url:
        models = httpx.get(f"{url}/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["root"] == ENGINE_MODEL
        assert httpx.get(f"{url}/v1/runs/nope").status_code == 404


def test_a_rank_above_the_engines_limit_is_refused_before_any_training(
    redis_url: str, redis_conn: redis.Redis, tmp_path: Path, tokenizer: Any
) -> None:
    settings = settings_for(redis_url, tmp_path, ENGINE_MODEL)
    settings.engine.max_lora_rank = 16
    with gateway(settings, tokenizer, with_controller=False) as url:
        client = Client(url, conn=redis_conn)
        card = next(c for c in client.get("/v1/models")["data"] if c.get("root"))
        assert card["lora"] == {"max_rank": 16, "target_modules": list(DEFAULT_TARGETS)}
        with pytest.raises(ValidationFailed) as info:
            client.create_run("wide", base_model=ENGINE_MODEL, lora=LoraConfig(r=32, alpha=64))
        message = str(info.value)
        assert info.value.field == "lora.r" and "r=32" in message and "TANDEM_ENGINE__MAX_LORA_RANK" in message
        assert client.runs() == []
        assert client.create_run("fits", base_model=ENGINE_MODEL, lora=LoraConfig(r=16)).spec.lora.r == 16
        client.close()


def test_modules_sglang_prepares_no_lora_for_are_refused(
    redis_url: str, redis_conn: redis.Redis, tmp_path: Path, tokenizer: Any
) -> None:
    settings = settings_for(redis_url, tmp_path, ENGINE_MODEL)
    settings.engine.kind = "sglang"  # the card is the gateway's; no engine answers here
    settings.engine.lora_target_modules = ("q_proj", "v_proj")
    with gateway(settings, tokenizer, with_controller=False) as url:
        client = Client(url, conn=redis_conn)
        with pytest.raises(ValidationFailed) as info:
            client.create_run("all", base_model=ENGINE_MODEL, lora=LoraConfig(target_modules=DEFAULT_TARGETS))
        assert info.value.field == "lora.target_modules" and "'o_proj'" in str(info.value)
        assert "'q_proj'" not in str(info.value).split("prepares")[0]
        run = client.create_run("qv", base_model=ENGINE_MODEL, lora=LoraConfig(target_modules=("q_proj", "v_proj")))
        assert run.spec.lora.target_modules == ("q_proj", "v_proj") and client.runs() == ["qv"]
        client.close()


@pytest.mark.parametrize("engine_modules", [("all",), ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")])
def test_all_and_sglangs_fused_names_take_every_module_they_cover(
    redis_url: str, redis_conn: redis.Redis, tmp_path: Path, tokenizer: Any, engine_modules: tuple[str, ...]
) -> None:
    settings = settings_for(redis_url, tmp_path, ENGINE_MODEL)
    settings.engine.kind = "sglang"
    settings.engine.lora_target_modules = engine_modules
    with gateway(settings, tokenizer, with_controller=False) as url:
        client = Client(url, conn=redis_conn)
        assert client.create_run("every", base_model=ENGINE_MODEL).spec.lora.target_modules == DEFAULT_TARGETS
        client.close()


def test_vllm_takes_any_module(redis_url: str, redis_conn: redis.Redis, tmp_path: Path, tokenizer: Any) -> None:
    settings = settings_for(redis_url, tmp_path, ENGINE_MODEL)
    settings.engine.kind = "vllm"
    settings.engine.max_lora_rank = 16
    settings.engine.lora_target_modules = ("q_proj",)  # not a vLLM flag: it loads adapters on any module
    with gateway(settings, tokenizer, with_controller=False) as url:
        client = Client(url, conn=redis_conn)
        card = next(c for c in client.get("/v1/models")["data"] if c.get("root"))
        assert card["lora"] == {"max_rank": 16}
        assert client.create_run("any", base_model=ENGINE_MODEL).spec.lora.target_modules == DEFAULT_TARGETS
        client.close()
