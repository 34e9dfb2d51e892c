"""Drives one compose project of the CPU stack (`compose.yaml` + `compose.cpu.yaml`) for the e2e tier.

`ComposeStack` wraps the compose CLI (`docker compose`, v2.24 or newer) with the
project's name, files and env file, and answers what the tests ask: a service's container,
health and restart count, its logs, `exec`, and `probe`: a script of this directory run with
the container's own Python while the test goes on (`Probe` reads its output line by line).
The `stack` fixture (conftest.py) builds and starts it, and always takes it down with `down -v`.

The stack runs with compose.client.yaml on top, which publishes Redis on a loopback port
(REDIS_PORT): the test process is a tandem client, and a client needs Redis for train jobs.
compose.yaml itself publishes the gateway only.

Environment: TANDEM_COMPOSE (the compose command, default `docker compose`),
TANDEM_E2E_KEEP=1 (leave the stack up after the tests, for debugging).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.loopback import free_port
from helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("redis", "engine", "inference", "trainer")
#: The tiny model inside the containers: the `models` volume, built by the stack's `model` service.
MODEL = "/models/tiny"


def compose_command() -> list[str]:
    if os.environ.get("TANDEM_COMPOSE"):
        return shlex.split(os.environ["TANDEM_COMPOSE"])
    return ["docker", "compose"]


def docker_answers() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.5) -> None:
    """`wait_until` for a stack whose services may be restarting: their errors count as "not yet"."""
    wait_until(predicate, timeout_s, what, interval_s=interval_s, ignoring=(Exception,))


@dataclass
class ComposeStack:
    """One compose project of the CPU stack, driven through the compose CLI."""

    project: str
    env_file: Path
    gateway_url: str
    redis_url: str
    """The client's Redis user's URL (what a tandem.Client on this host uses)."""
    redis_password: str
    """Redis's admin password (REDISCLI_AUTH in the redis container)."""
    engine_admin_key: str
    dashboard_url: str
    role_passwords: dict[str, str] = field(default_factory=dict)
    """The password of each role's Redis user, by .env variable (REDIS_CLIENT_PASSWORD, ...)."""
    files: tuple[str, ...] = ("compose.yaml", "compose.cpu.yaml", "compose.client.yaml")
    services: tuple[str, ...] = SERVICES
    """The services `wait_healthy` waits for by default."""
    timings: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [*compose_command(), "--env-file", str(self.env_file), "-p", self.project]
        for f in self.files:
            argv += ["-f", f]
        proc = subprocess.run([*argv, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        if check and proc.returncode != 0:
            raise AssertionError(f"`{' '.join(argv[-2:])} {' '.join(args)}` failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        return proc

    def container(self, service: str) -> str:
        [cid] = self.containers(service)
        return cid

    def containers(self, service: str) -> list[str]:
        """The service's containers (one per replica)."""
        # -a: compose v2 lists running containers only, and a killed one must still be found
        cids = self.compose("ps", "-a", "-q", service).stdout.split()
        assert cids, f"no container for service {service}"
        return cids

    def health(self, service: str) -> str:
        """'running healthy' when every container of the service is; else the first other state."""
        states = []
        for cid in self.containers(service):
            out = subprocess.run(["docker", "inspect", "--format", "{{.State.Status}} {{if .State.Health}}"
                                  "{{.State.Health.Status}}{{end}}", cid], capture_output=True, text=True, check=True)
            states.append(out.stdout.strip())
        return next((state for state in states if state != "running healthy"), states[0])

    def wait_healthy(self, *services: str, timeout_s: float = 240) -> None:
        for service in services or self.services:
            wait_for(lambda s=service: self.health(s) == "running healthy", timeout_s, f"{service} to be healthy")

    def logs(self, tail: int = 300) -> str:
        return self.compose("logs", "--no-color", f"--tail={tail}", check=False).stdout

    def logs_of(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False).stdout

    def docker(self, *args: str, timeout_s: float = 120, stderr: bool = False) -> str:
        """`docker ARGS`' stdout (and stderr, where services log, with stderr=True)."""
        proc = subprocess.run(["docker", *args], capture_output=True, text=True, check=True, timeout=timeout_s)
        return proc.stdout + proc.stderr if stderr else proc.stdout

    def exec(self, service: str, *argv: str) -> str:
        return self.compose("exec", "-T", service, *argv).stdout

    def restart_count(self, service: str) -> int:
        """How often the restart policy has restarted the service's container."""
        return int(self.docker("inspect", "--format", "{{.RestartCount}}", self.container(service)).strip())

    def probe(self, service: str, script: str, *args: str) -> Probe:
        """Run tests/e2e/`script` inside the service's container (`python -c`), in the background."""
        source = (Path(__file__).parent / script).read_text()
        argv = ["docker", "exec", "-i", self.container(service), "python", "-c", source, *args]
        return Probe(script, subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))


class Probe:
    """A script running in a container: its stdout as lines, its stdin as the signal to stop."""

    def __init__(self, name: str, proc: subprocess.Popen[str]) -> None:
        self.name, self.proc = name, proc
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        self.readers = [threading.Thread(target=self._read, daemon=True),
                        threading.Thread(target=lambda: self.stderr.extend(proc.stderr or []), daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def line(self, timeout_s: float) -> str:
        """The next line it prints; fails when it ends first or prints nothing in time."""
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.name} printed nothing for {timeout_s:.0f} s") from None
        if line is None:
            self.proc.wait(10)
            raise AssertionError(f"{self.name} ended ({self.proc.returncode}): {''.join(self.stderr)[-3000:]}")
        return line

    def json_line(self, timeout_s: float) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.line(timeout_s))
        return result

    def close(self, timeout_s: float = 60) -> dict[str, Any]:
        """Close its input (the watcher's signal to finish) and return the JSON it prints last."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        summary = self.json_line(timeout_s)
        self.proc.wait(timeout_s)
        return summary

    def stop(self) -> None:
        """End it (closing its input ends the script in the container too) and release its pipes."""
        assert self.proc.stdin is not None
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for reader in self.readers:
            reader.join(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def role_passwords() -> dict[str, str]:
    """A random password for each role's Redis user, by .env variable, as `make .env` writes them."""
    return {f"REDIS_{role}_PASSWORD": secrets.token_hex(16) for role in ("CLIENT", "INFERENCE", "TRAINER", "TINKER")}


def started_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, *,
                  files: tuple[str, ...] = (), env: str = "",
                  services: tuple[str, ...] = SERVICES, profiles: tuple[str, ...] = ()) -> Iterator[ComposeStack]:
    """Build and start the CPU stack with `files` on top, `env` lines in its .env and the services of
    `profiles` too; take it down after."""
    if not docker_answers():
        pytest.skip("no docker engine answers (images/install-docker.sh installs and starts one)")
    subprocess.run(["images/build-base.sh"], cwd=ROOT, check=True, timeout=900)
    workdir = tmp_path_factory.mktemp("compose")
    gateway_port, redis_port, dashboard_port = free_port(), free_port(), free_port()
    env_file = workdir / ".env"
    password, admin_key = secrets.token_hex(16), secrets.token_hex(16)
    roles = role_passwords()
    env_file.write_text(
        f"REDIS_PASSWORD={password}\nENGINE_ADMIN_KEY={admin_key}\nGATEWAY_PORT={gateway_port}\n"
        f"REDIS_PORT={redis_port}\nRQ_DASHBOARD_PORT={dashboard_port}\n"
        + "".join(f"{k}={v}\n" for k, v in roles.items()) + env
    )
    s = ComposeStack(
        project=f"tandem-e2e-{os.getpid()}" + ("-" + "-".join(Path(f).stem.split(".")[-1] for f in files) if files else ""),
        env_file=env_file,
        gateway_url=f"http://127.0.0.1:{gateway_port}",
        redis_url=f"redis://tandem-client:{roles['REDIS_CLIENT_PASSWORD']}@127.0.0.1:{redis_port}/0",
        redis_password=password,
        engine_admin_key=admin_key,
        dashboard_url=f"http://127.0.0.1:{dashboard_port}",
        role_passwords=roles,
        services=services,
    )
    if files:
        s.files = (*s.files, *files)
    failed_before = request.session.testsfailed
    started = False
    try:
        t0 = time.monotonic()
        s.compose("--profile", "monitoring", "--profile", "metrics", "build", timeout_s=1200)
        s.timings["build_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        s.compose(*(a for p in profiles for a in ("--profile", p)), "up", "-d", timeout_s=600)
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
            s.compose("--profile", "monitoring", "--profile", "metrics", "down", "-v", "--remove-orphans", "-t", "30",
                      check=False, timeout_s=300)
