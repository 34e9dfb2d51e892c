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
import shlex
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("redis", "engine", "inference", "trainer")


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
    redis_password: str
    engine_admin_key: str
    dashboard_url: str
    files: tuple[str, ...] = ("compose.yaml", "compose.cpu.yaml", "compose.client.yaml")
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
        # -a: compose v2 lists running containers only, and a killed one must still be found
        cid = self.compose("ps", "-a", "-q", service).stdout.strip()
        assert cid, f"no container for service {service}"
        return cid

    def health(self, service: str) -> str:
        out = subprocess.run(["docker", "inspect", "--format", "{{.State.Status}} {{if .State.Health}}"
                              "{{.State.Health.Status}}{{end}}", self.container(service)],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    def wait_healthy(self, *services: str, timeout_s: float = 240) -> None:
        for service in services or SERVICES:
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
