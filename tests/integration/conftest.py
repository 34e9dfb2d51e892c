"""Fixtures of the integration tier that several modules use."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from workers import WorkerProcess, start_workers, stop_workers


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    root = tmp_path / "adapters"
    root.mkdir()
    start, started = start_workers(redis_url, root, tmp_path)
    yield start
    stop_workers(started)
