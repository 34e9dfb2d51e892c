"""Steady traffic for the tests that take a replica away mid-run: no request may fail meanwhile."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


@contextmanager
def steady_requests(gateway_url: str, model: str) -> Iterator[Counter[int]]:
    """Short completions of `model`, one after another, for as long as the block runs; yields the
    count of each HTTP status, complete once the block has ended."""
    statuses: Counter[int] = Counter()
    stop = threading.Event()

    def keep_asking() -> None:
        with httpx.Client(base_url=gateway_url, timeout=60) as http:
            i = 0
            while not stop.is_set():
                i += 1
                reply = http.post("/v1/completions", json={"model": model, "prompt": f"{i} count", "max_tokens": 2})
                statuses[reply.status_code] += 1

    asker = threading.Thread(target=keep_asking, daemon=True)
    asker.start()
    try:
        yield statuses
    finally:
        stop.set()
        asker.join(60)
