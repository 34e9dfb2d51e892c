"""Fixtures of the integration tier that several modules use."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
from helpers.workers import WorkerProcess, start_workers, stop_workers

from tandem.registry import Registry
from tandem.runs import RunSpec

if TYPE_CHECKING:  # the gateway's environment, which the gpu tests' interpreters may lack
    from helpers.servers import Servers


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    root = tmp_path / "adapters"
    root.mkdir()
    start, started = start_workers(redis_url, root, tmp_path)
    yield start
    stop_workers(started)


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tiny_model: Path, redis_url: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """The tiny model's engine and a gateway without a controller, shared by the module.

    Both bound max_tokens by the module's MAX_TOKENS (64 when it sets none), which keeps
    generation short where a module sends many requests.
    """
    from helpers.servers import engine_and_gateway

    limit = getattr(request.module, "MAX_TOKENS", 64)
    with engine_and_gateway(tiny_model, redis_url, tmp_path_factory.mktemp("store"), limit=limit) as s:
        yield s


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
