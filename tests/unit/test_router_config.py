"""The router's configuration (images/router/haproxy.cfg): valid, and the local stack's copy of it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tandem.dev.composition import ROUTER_CONF, StackConfig
from tandem.dev.stack import Stack

needs_haproxy = pytest.mark.skipif(shutil.which("haproxy") is None,
                                   reason="haproxy is not installed (apt-get install haproxy; .ci/run installs it)")


@needs_haproxy
def test_the_images_router_configuration_is_valid_haproxy() -> None:
    env = {**os.environ, "ROUTER_BIND": "0.0.0.0", "ROUTER_PORT": "8000", "ROUTER_REPLICAS": "inference",
           "ROUTER_REPLICA_PORT": "8000", "ROUTER_MAX_REPLICAS": "8"}
    checked = subprocess.run(["haproxy", "-c", "-f", str(ROUTER_CONF)], env=env, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@needs_haproxy
def test_the_local_stack_lists_each_replica_on_loopback_in_a_copy_of_it(tmp_path: Path) -> None:
    stack = Stack(StackConfig(state_dir=tmp_path, gateway_port=0, redis_port=0, replicas=3))
    text = stack._router_conf().read_text()
    servers = [line.split() for line in text.splitlines() if line.strip().startswith("server ")]
    assert [(s[1], s[2]) for s in servers] == [(f"replica-{i}", f"127.0.0.1:{gw}")
                                               for i, (_, gw) in enumerate(stack.replicas, start=1)]
    assert len({gw for _, gw in stack.replicas} | {e for e, _ in stack.replicas}) == 6  # every port its own
    assert f"bind 127.0.0.1:{stack.gateway_port}" in text and "server-template" not in text
    assert "option httpchk GET /ready" in text and "retry-on conn-failure" in text
    checked = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "router" / "haproxy.cfg")],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
