"""Supervision of the local stack's processes: start each service with its own log file, wait until
it is ready, start again any that dies (after a pause that grows while it keeps dying), and stop
them in reverse order.

The supervisor knows services only as `Service`s -- a name, a command line, extra environment and
a readiness probe -- and nothing of what they are (tandem.dev.composition says that). It holds
the state directory while it runs: its lock (`stack.lock`) and the logs under `logs/`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.child import guarded
from tandem.errors import ConfigError, StackError

log = logging.getLogger("tandem.dev.stack")
"""`tandem up`'s log: every line of the stack under one name, whichever module writes it."""


#: The services' umask: what they write in the state directory is their user's alone.
PRIVATE_UMASK = 0o077


@dataclass
class Service:
    """One process of the stack: what to run and how to tell it is ready, then its process."""

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


class Supervisor:
    """Start, watch and stop services, from one state directory (see StackConfig for the times)."""

    def __init__(self, state: Path, *, ready_timeout_s: float, restart_backoff_s: float,
                 restart_backoff_max_s: float, restart_reset_s: float) -> None:
        self.state = state
        self.logs = state / "logs"
        self.ready_timeout_s = ready_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.restart_backoff_max_s = restart_backoff_max_s
        self.restart_reset_s = restart_reset_s
        self.services: list[Service] = []
        """The services started, in order."""
        self._lock_fd: int | None = None
        """The state directory's lock (`stack.lock`), held while the stack runs."""

    def open(self) -> None:
        """Make the log directory and take the state directory's lock, before any service starts.

        The state directory is the stack's user's alone (0700, and every service writes with umask
        077): Redis's data holds every run, queued job and episode, the logs their prompts. Opening
        an open supervisor again does nothing."""
        if self._lock_fd is not None:
            return
        try:
            self.logs.mkdir(parents=True, exist_ok=True)
            self.state.chmod(0o700)
        except OSError as exc:
            raise ConfigError(f"cannot make the log directory {self.logs} ({exc}); give the stack a state "
                              "directory it can write (`tandem up --state-dir DIR`)") from exc
        self._lock_state()

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

    def start(self, svc: Service, env: dict[str, str]) -> None:
        """Start `svc` with `env` (and its own env over it), logging to `logs/<name>.log`, and wait
        until it is ready; if it dies or runs out of time first, stop every service and raise StackError."""
        self.spawn(svc, env)
        self.wait_ready(svc)

    def spawn(self, svc: Service, env: dict[str, str]) -> None:
        """Start `svc` as `start` does, without waiting for it: `wait_ready` does, later."""
        svc.log_path = self.logs / f"{svc.name}.log"
        log.info("starting %s (log: %s)", svc.name, svc.log_path)
        self._spawn(svc, env)
        self.services.append(svc)

    def wait_ready(self, svc: Service) -> None:
        """Until the spawned `svc` is ready; if it dies or runs out of time first (counted from
        now), stop every service and raise StackError."""
        self._wait_ready(svc)
        log.info("%s ready in %.1f s", svc.name, time.monotonic() - svc.started_at)

    def _spawn(self, svc: Service, env: dict[str, str]) -> None:
        assert svc.log_path is not None
        try:
            svc.log_path.touch(mode=0o600)
            with svc.log_path.open("ab") as out:
                # started from the main thread (the stack's own), a service dies with the supervisor,
                # SIGKILL included: one left running would hold the stack's ports and files
                argv = guarded(svc.argv) if threading.current_thread() is threading.main_thread() else svc.argv
                svc.proc = subprocess.Popen(
                    argv, env={**env, **svc.env}, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, umask=PRIVATE_UMASK,
                )
        except OSError as exc:
            raise StackError(f"cannot start {svc.name} ({svc.argv[0]}, log {svc.log_path}): {exc}") from exc
        svc.started_at = time.monotonic()

    def supervise(self, should_stop: Callable[[], bool], env: dict[str, str], poll_s: float = 0.2) -> None:
        """Until `should_stop()`: start again, with `env`, every service whose process died.

        The pause before a restart starts at `restart_backoff_s` and doubles with each death in
        a row, up to `restart_backoff_max_s`; a service that ran `restart_reset_s` before it
        died is a new case and waits the shortest pause again. A restarted service is not
        waited for: the others retry their connections until it is back.
        """
        due: dict[str, float] = {}
        while not should_stop():
            now = time.monotonic()
            for svc in self.services:
                if svc.proc is None or svc.proc.poll() is None:
                    continue
                if svc.name not in due:
                    if now - svc.started_at >= self.restart_reset_s:
                        svc.deaths = 0
                    pause = min(self.restart_backoff_s * 2**svc.deaths, self.restart_backoff_max_s)
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
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._probe(svc):
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
                    f"{svc.name} not ready after {self.ready_timeout_s:.0f} s; "
                    f"last lines of {svc.log_path}:\n{tail(svc.log_path)}"
                )
            time.sleep(0.2)

    def _probe(self, svc: Service) -> bool:
        """`svc.ready()`; a probe that found another stack's process in this one's place (a
        StackError) stops every service before the error goes on."""
        try:
            return svc.ready()
        except StackError:
            self.stop()
            raise

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

    def restart(self, name: str, env: dict[str, str]) -> None:
        """Start one service again, with `env`, after it died or was killed."""
        svc = self.service(name)
        self.kill(name, signal.SIGTERM)
        self._spawn(svc, env)
        self._wait_ready(svc)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop services in reverse order: SIGTERM, then SIGKILL after `timeout_s`; then let the
        state directory go."""
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


def tail(path: Path | None, lines: int = 30) -> str:
    """The last `lines` lines of a log, for an error message."""
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
