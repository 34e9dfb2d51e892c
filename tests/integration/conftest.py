"""Fixtures of the integration tier that several modules use."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
from helpers.workers import WorkerProcess, start_workers, stop_workers

from tandem.acl import Role
from tandem.registry import Registry
from tandem.runs import RunSpec

if TYPE_CHECKING:  # the gateway's environment, which the gpu tests' interpreters may lack
    from helpers.servers import Servers

    from tandem.settings import InferenceSettings


@pytest.fixture
def workers(role_urls: dict[Role, str], tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Trainer workers as the trainer's Redis user."""
    root = tmp_path / "adapters"
    root.mkdir()
    start, started = start_workers(role_urls[Role.TRAINER], root, tmp_path)
    yield start
    stop_workers(started)


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tiny_model: Path, role_urls: dict[Role, str],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """The tiny model's engine and a gateway without a controller (as the inference's Redis user),
    shared by the module.

    Both bound max_tokens by the module's MAX_TOKENS (64 when it sets none), which keeps
    generation short where a module sends many requests.
    """
    from helpers.servers import engine_and_gateway

    limit = getattr(request.module, "MAX_TOKENS", 64)
    with engine_and_gateway(tiny_model, role_urls[Role.INFERENCE], tmp_path_factory.mktemp("store"), limit=limit) as s:
        yield s


@pytest.fixture
def role_conns(redis_conn: redis.Redis, role_urls: dict[Role, str]) -> Iterator[dict[Role, redis.Redis]]:
    """A connection as each role's Redis user (tandem.acl), to the flushed Redis of `redis_conn`."""
    conns = {role: redis.Redis.from_url(url) for role, url in role_urls.items()}
    yield conns
    for conn in conns.values():
        conn.close()


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    """The tiny model's transformers engine with room for adapters (rank up to 16, 64 of them), shared
    by the module (a module that needs another engine defines its own `engine_url`)."""
    from helpers.loopback import serve_app

    from tandem.settings import EngineSettings
    from tandem_inference.engines.transformers.server import create_engine_app

    settings = EngineSettings(model=str(tiny_model), device="cpu", max_lora_rank=16, max_loaded_adapters=64)
    with serve_app(create_engine_app(settings)) as url:
        yield url


@pytest.fixture
def settings(role_urls: dict[Role, str], tmp_path: Path, engine_url: str, tiny_model: Path) -> InferenceSettings:
    """The settings of a gateway and its controller in front of `engine_url`, as the inference's Redis
    user, its store under tmp_path."""
    from helpers.servers import inference_settings

    return inference_settings(role_urls[Role.INFERENCE], tmp_path / "store", engine_url, tiny_model)


@pytest.fixture
def url(settings: InferenceSettings, tokenizer: Any, redis_conn: redis.Redis) -> Iterator[str]:
    """The gateway with its controller, served as the inference service serves it; its URL."""
    from helpers.servers import gateway

    with gateway(settings, tokenizer) as u:
        yield u


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    """The tiny model's tokenizer (the gateway wants one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def run(redis_conn: redis.Redis, tiny_model: Path) -> str:
    """A run of the tiny model under a fresh name (engines shared by a module must not see a name twice)."""
    name = f"r{uuid.uuid4().hex[:8]}"
    Registry(redis_conn).create_run(RunSpec(name=name, base_model=str(tiny_model)))
    return name
