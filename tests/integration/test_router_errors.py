"""The router with no replica in rotation answers like the gateway does: JSON with Retry-After."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from helpers.waiting import wait_until

from tandem.dev.composition import StackConfig
from tandem.dev.stack import Stack

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("haproxy") is None,
                                 reason="haproxy is not installed (apt-get install haproxy; .ci/run installs it)")]


def test_no_replica_in_rotation_is_an_openai_shaped_503_with_retry_after(tmp_path: Path) -> None:
    stack = Stack(StackConfig(state_dir=tmp_path, gateway_port=0, redis_port=0, replicas=2))  # nothing listens there
    router = subprocess.Popen(["haproxy", "-db", "-f", str(stack._router_conf())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{stack.gateway_port}"
    try:
        def answered() -> httpx.Response | None:
            try:
                return httpx.post(f"{url}/v1/chat/completions", json={"model": "base", "messages": []}, timeout=10)
            except httpx.TransportError:
                return None

        wait_until(lambda: answered() is not None, what="the router listening", timeout_s=20)
        reply = answered()
        assert reply is not None and reply.status_code == 503
        assert reply.headers["content-type"].startswith("application/json")
        assert int(reply.headers["retry-after"]) >= 1
        error = reply.json()["error"]
        assert error["code"] == 503 and error["type"] == "service_unavailable" and "replica" in error["message"]
    finally:
        router.terminate()
        router.wait(timeout=10)
