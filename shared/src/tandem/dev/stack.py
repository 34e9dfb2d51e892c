"""The whole stack as local processes, for development, tests and the CPU demo.

`tandem up` starts Redis, the engine, the inference service (controller + gateway) and the
trainer -- the services of tandem.dev.composition -- each as a process with its own log file,
waits until each is healthy, starts again any that dies (after a pause that grows while it keeps
dying), and stops them in reverse order on Ctrl-C (tandem.dev.supervisor). It is the same set of
services `docker compose` runs, without containers.

Everything listens on loopback, and nothing is open to other local users: Redis has passwords
(its admin's, and one per role's user, tandem.acl) and the engine an admin key, all generated
once and kept in the state directory (`secrets.json`, mode 0600; Redis reads them from
`redis/redis.conf`, never from a command line). Each service gets its own role's Redis URL, the
engine none. Once every service is ready, the stack writes the URLs to use, Redis as the client's
user with its password, to `client.env` there (mode 0600), which `tandem.Client()` and `tandem
status` read when run from the same directory (see tandem.settings.LOCAL_STACK_ENV).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from tandem.dev.composition import Composition, StackConfig
from tandem.dev.supervisor import Service, Supervisor


class Stack(Composition):
    """The composition's services, started, watched and stopped by a supervisor; a context manager."""

    def __init__(self, config: StackConfig) -> None:
        super().__init__(config)
        self.supervisor = Supervisor(self.state, ready_timeout_s=config.ready_timeout_s,
                                     restart_backoff_s=config.restart_backoff_s,
                                     restart_backoff_max_s=config.restart_backoff_max_s,
                                     restart_reset_s=config.restart_reset_s)
        self.logs = self.supervisor.logs

    @property
    def services(self) -> list[Service]:
        """The services started, in order (empty before start and after stop)."""
        return self.supervisor.services

    def start(self) -> Stack:
        """Check the ports, hold the state directory, start every service of the plan in order and
        wait for each, then write client.env; whatever fails stops what started.

        The trainer needs Redis only: it starts as soon as the stack's Redis is ready (first, with
        an external Redis) and loads its libraries while the engines and inference services start,
        and is waited for in its place in the plan."""
        self.check_ports()
        self.supervisor.open()
        try:
            env = self.env()
            plan = self.plan()
            trainer = next((svc for svc in plan if svc.name == "trainer"), None)
            for svc in plan:
                if svc is trainer:
                    if svc.proc is None:
                        self.supervisor.spawn(svc, env)
                    self.supervisor.wait_ready(svc)
                    continue
                if trainer is not None and trainer.proc is None and svc.name != "redis":
                    self.supervisor.spawn(trainer, env)
                self.supervisor.start(svc, env)
            order = {id(svc): i for i, svc in enumerate(plan)}
            self.supervisor.services.sort(key=lambda svc: order[id(svc)])  # they stop in reverse
            self.write_client_env()
        except BaseException:
            self.stop()  # the ones already started, and the state directory's lock
            raise
        return self

    def supervise(self, should_stop: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Until `should_stop()`: start again every service whose process died (Supervisor.supervise)."""
        self.supervisor.supervise(should_stop, self.env(), poll_s)

    def service(self, name: str) -> Service:
        return self.supervisor.service(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one service (for crash tests)."""
        self.supervisor.kill(name, sig)

    def restart(self, name: str) -> None:
        """Start one service again after it died or was killed."""
        self.supervisor.restart(name, self.env())

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop services in reverse order: SIGTERM, then SIGKILL after `timeout_s`."""
        self.supervisor.stop(timeout_s)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
