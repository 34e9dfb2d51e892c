"""Starts a replica's own engine as a child process and keeps it running.

The engine runs from its own command line and environment (SGLang's and vLLM's each in an
environment of its own: their pins conflict with tandem's and each other's;
engines/sglang_launcher.py and vllm_launcher.py build them). The launcher
starts it, waits until it is healthy, and supervises it: when
the process dies (or the controller asks, e.g. after an unload that hung), it starts it
again and calls `on_restart`, so the controller reloads the versions that were serving.
Restarts are bounded (`max_restarts` within `restart_window_s`); past that bound, or when a
restart fails to boot, the service stops itself so that whatever runs it starts it afresh.

The engine never outlives the service: `stop()` ends its whole process group; if the service
itself dies without stopping it (a crash, SIGKILL), the kernel kills the engine
(PR_SET_PDEATHSIG, set by tandem.child's guard, which then execs the engine; SGLang's scheduler
and detokenizer ask the same of their parent, the engine, so they follow it); and anything of an engine
that a previous run left behind (named by the pid file) is killed before a new one starts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx

from tandem.acl import without_credentials
from tandem.child import guarded
from tandem.errors import ConfigError
from tandem.settings import InferenceSettings
from tandem_inference.errors import EngineBootError

log = logging.getLogger(__name__)

def loopback_host(url: str, engine: str, why: str) -> str:
    """The host an engine is to listen on, from engine.url; ConfigError unless it is a loopback address."""
    host = urlparse(url).hostname or "127.0.0.1"
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"engine.url {url!r} makes {engine} listen on {host}: {why}, so tandem runs it on loopback only; "
            "set TANDEM_ENGINE__URL to http://127.0.0.1:<port>"
        )
    return host


def engine_env(settings: InferenceSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every engine starts from: `base` (this process's) without its Redis URL (an
    engine uses none), on the inference GPUs."""
    env = without_credentials(os.environ if base is None else base)
    if settings.gpus.mode != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in settings.gpus.inference)
    return env


#: Flags whose value is a key (SGLang's admin key; an API key passed in `engine.extra_args`).
_SECRET_FLAGS = frozenset({"--admin-api-key", "--api-key"})


def _shown(argv: list[str]) -> list[str]:
    """The command line with keys replaced by '***', for logs and the pid file."""
    return [a if prev not in _SECRET_FLAGS else "***" for prev, a in zip(["", *argv], argv, strict=False)]


def _start_time(pid: int) -> int | None:
    """When the process started (clock ticks after boot, /proc/PID/stat field 22); None if gone.

    A pid names one process only together with its start time: pids are reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    return int(stat.rsplit(")", 1)[1].split()[19])


def _port_taken(host: str, port: int) -> bool:
    """Whether something listens on host:port (a bind with SO_REUSEADDR fails only then)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class Launcher:
    """Own one engine process: start, wait healthy, restart on death, stop."""

    def __init__(
        self,
        settings: InferenceSettings,
        http: httpx.AsyncClient,
        *,
        argv: list[str],
        env: dict[str, str],
        log_path: Path | None = None,
        pid_path: Path | None = None,
        on_restart: Callable[[], Awaitable[None]] | None = None,
        health_poll_s: float = 0.5,
    ) -> None:
        self.settings = settings
        self.http = http
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.pid_path = pid_path  # names the running engine, for the next run to reap if this one cannot
        self.on_restart = on_restart
        self.on_down: Callable[[], None] | None = None
        """Called as a restart begins: the engine's adapters are gone until `on_restart` loads them."""
        self.health_poll_s = health_poll_s  # pause between /health probes while booting
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts: deque[float] = deque()
        self.boot_s: float | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        return self.settings.engine.url

    async def start(self) -> float:
        """Start the engine and wait until it is healthy; returns the boot time in seconds."""
        t0 = time.monotonic()
        await asyncio.to_thread(self.reap_leftover)  # waits up to 30 s for a leftover to die
        url = urlparse(self.url)
        host, port = url.hostname or "127.0.0.1", url.port or 30000
        if await asyncio.to_thread(_port_taken, host, port):
            raise EngineBootError(
                f"port {port} of engine.url {self.url} is in use by a process this launcher did not start; "
                f"stop it (`fuser {port}/tcp` names it) or set TANDEM_ENGINE__URL to a free port"
            )
        log.info("starting engine: %s", " ".join(_shown(self.argv)))
        try:
            proc = self._spawn()
        except OSError as exc:
            raise EngineBootError(
                f"cannot start the engine ({exc}); check that {self.log_path or 'the log directory'} and "
                f"{self.pid_path or 'the pid file'} can be written and that {self.argv[0]!r} "
                "(engine.sglang_python or engine.vllm_python) exists"
            ) from exc
        await self.wait_healthy(self.settings.engine.boot_timeout_s)
        self.boot_s = time.monotonic() - t0
        log.info("engine healthy in %.1f s (pid %d)", self.boot_s, proc.pid)
        return self.boot_s

    def _spawn(self) -> subprocess.Popen[bytes]:
        """Start the engine's process, its output into the log file (or this process's output when
        there is none), and record it in the pid file."""
        out = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                guarded(self.argv), env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()
        self._write_pid()
        return self.proc

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineBootError(
                    f"engine exited with code {self.proc.returncode} while booting; see {self.log_path or 'its output'}"
                )
            try:
                resp = await self.http.get(f"{self.url}/health", timeout=5.0)
                if resp.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(self.health_poll_s)
        raise EngineBootError(f"engine at {self.url} not healthy after {timeout_s:.0f} s; see {self.log_path}")

    def _write_pid(self) -> None:
        if self.pid_path is None or self.proc is None:
            return
        record = {"pid": self.proc.pid, "start_time": _start_time(self.proc.pid), "argv": _shown(self.argv)}
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.pid_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.pid_path)

    def reap_leftover(self, timeout_s: float = 30.0) -> None:
        """Kill the engine a previous run of this service left running, as its pid file names it.

        The pid file holds the engine's pid (its process group: it leads one) and start time. The
        group is killed when its leader is that very process (same start time), or when the
        leader is gone but members are left (a group id is not reused while the group has
        members). A pid reused by an unrelated process is left alone.
        """
        if self.pid_path is None:
            return
        try:
            record = json.loads(self.pid_path.read_text())
            pid, started = int(record["pid"]), record["start_time"]
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable engine pid file %s: %s", self.pid_path, exc)
            self.pid_path.unlink(missing_ok=True)
            return
        now = _start_time(pid)
        if now is not None and now != started:
            log.info("pid %d of %s is another process now; nothing to reap", pid, self.pid_path)
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the engine and everything it started are gone
            else:
                log.warning("killed engine process group %d left by a previous run (%s)", pid, record.get("argv"))
                deadline = time.monotonic() + timeout_s
                while _group_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
        self.pid_path.unlink(missing_ok=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _allow_restart(self) -> bool:
        now = time.monotonic()
        window = self.settings.engine.restart_window_s
        while self.restarts and now - self.restarts[0] > window:
            self.restarts.popleft()
        return len(self.restarts) < self.settings.engine.max_restarts

    async def restart(self, reason: str) -> None:
        """Stop (if running) and start again, then let the controller reload what served."""
        if not self._allow_restart():
            raise EngineBootError(
                f"engine restarted {len(self.restarts)} times in {self.settings.engine.restart_window_s:.0f} s; "
                f"giving up (last reason: {reason})"
            )
        self.restarts.append(time.monotonic())
        log.warning("restarting engine: %s", reason)
        if self.on_down is not None:
            self.on_down()
        self.terminate()
        await self.start()
        if self.on_restart is not None:
            await self.on_restart()

    async def supervise(self, poll_s: float = 1.0) -> None:
        """Run until stopped: restart the engine whenever its process dies.

        When the engine cannot be brought back (restarts used up, a boot that fails), the
        service has nothing left to serve: it sends itself SIGTERM, so its normal shutdown
        runs (stopping the engine) and whatever runs it (compose, `tandem up`) starts it again.
        """
        while not self._stopping:
            if not self.alive() and not self._stopping:
                code = self.proc.returncode if self.proc else None
                try:
                    await self.restart(f"process exited with code {code}")
                except EngineBootError as exc:
                    log.error("engine supervision gave up, stopping the service: %s", exc)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
            await asyncio.sleep(poll_s)

    def terminate(self, timeout_s: float = 30.0) -> None:
        """Stop the engine and everything it started.

        SGLang's scheduler and detokenizer are child processes in the engine's process group;
        they can outlive a leader that crashed and keep the GPU memory, so the whole group is
        killed even when the leader is already gone.
        """
        if self.proc is None:
            return
        group = self.proc.pid  # start_new_session: the leader's pid is the group id
        if self.proc.poll() is None:
            try:
                os.killpg(group, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("engine did not stop in %.0f s; killing it", timeout_s)
            except ProcessLookupError:
                pass
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        if self.pid_path is not None:
            self.pid_path.unlink(missing_ok=True)

    def stop(self) -> None:
        self._stopping = True
        self.terminate()


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in process group `pgid`, read from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields 3 (state) and 5 (process group)
            return True
    return False
