"""The e2e tier's module-scoped `stack` fixture: the CPU container stack, built and started once.

It builds the images (docker caches the layers; dependencies come before the source), writes
an `.env` into a temporary directory (passed with --env-file, so a developer's own `.env` is
never touched), starts the stack under its own project name, waits until every service is
healthy and the published gateway is ready, and always tears it down with `down -v`. When a
test of the module failed, or the stack did not come up, every service's logs are printed;
they are written to `.tandem/e2e/<project>.log` every time.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from compose_stack import ROOT, ComposeStack, docker_answers, wait_for
from helpers.loopback import free_port


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    if not docker_answers():
        pytest.skip("no docker engine answers (images/install-docker.sh installs and starts one)")
    subprocess.run(["images/build-base.sh"], cwd=ROOT, check=True, timeout=900)
    workdir = tmp_path_factory.mktemp("compose")
    gateway_port, redis_port, dashboard_port = free_port(), free_port(), free_port()
    env_file = workdir / ".env"
    password, admin_key = secrets.token_hex(16), secrets.token_hex(16)
    env_file.write_text(
        f"REDIS_PASSWORD={password}\nENGINE_ADMIN_KEY={admin_key}\nGATEWAY_PORT={gateway_port}\n"
        f"REDIS_PORT={redis_port}\nRQ_DASHBOARD_PORT={dashboard_port}\n"
    )
    s = ComposeStack(
        project=f"tandem-e2e-{os.getpid()}",
        env_file=env_file,
        gateway_url=f"http://127.0.0.1:{gateway_port}",
        redis_url=f"redis://:{password}@127.0.0.1:{redis_port}/0",
        redis_password=password,
        engine_admin_key=admin_key,
        dashboard_url=f"http://127.0.0.1:{dashboard_port}",
    )
    failed_before = request.session.testsfailed
    started = False
    try:
        t0 = time.monotonic()
        s.compose("--profile", "monitoring", "build", timeout_s=1200)
        s.timings["build_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        s.compose("up", "-d", timeout_s=600)
        s.wait_healthy()
        wait_for(lambda: httpx.get(f"{s.gateway_url}/ready", timeout=3).status_code == 200, 60,
                 "the published gateway to be ready")
        s.timings["up_s"] = time.monotonic() - t0
        print(f"\ne2e stack {s.project}: build {s.timings['build_s']:.0f} s, up {s.timings['up_s']:.0f} s")
        started = True
        yield s
    finally:
        logs = s.logs()
        out = ROOT / ".tandem" / "e2e" / f"{s.project}.log"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(logs)
        if not started or request.session.testsfailed > failed_before:
            capture = request.config.pluginmanager.getplugin("capturemanager")
            with capture.global_and_fixture_disabled():
                print(f"\n===== docker-compose logs ({s.project}; all of it in {out}) =====\n{logs}")
        if os.environ.get("TANDEM_E2E_KEEP") == "1":
            print(f"TANDEM_E2E_KEEP=1: leaving {s.project} up (env file {env_file})")
        else:
            s.compose("--profile", "monitoring", "down", "-v", "--remove-orphans", "-t", "30", check=False,
                      timeout_s=300)
