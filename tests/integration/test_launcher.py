"""The launcher supervises a real engine process: restart on death, reload, no orphans left.

The engine never outlives the inference service: tests run the service itself
(`python -m tandem_inference.main`) with a stand-in engine in place of SGLang, a small HTTP
server that records how it ended, and stop it by SIGTERM, SIGINT and SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from helpers.loopback import free_port
from helpers.waiting import wait_until

from tandem.settings import EngineSettings, InferenceSettings
from tandem_inference.engines.launcher import Launcher
from tandem_inference.errors import EngineBootError

pytestmark = pytest.mark.integration

#: Stands in for `python -m sglang.launch_server ...`: serves GET /health on --port, writes
#: "started PID" and then the name of the signal that ends it into $STAND_IN_RECORD.
STAND_IN = """
import http.server, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
record = os.environ["STAND_IN_RECORD"]

def note(line):
    with open(record, "a") as f:
        f.write(line + "\\n")

def on_signal(signum, frame):
    note(signal.Signals(signum).name)
    sys.exit(0)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
server = http.server.HTTPServer(("127.0.0.1", port), Health)
note(f"started {os.getpid()}")
server.serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    """An executable that takes SGLang's command line (`PY -m sglang.launch_server ...`)."""
    script = tmp_path / "stand_in_engine.py"
    script.write_text(STAND_IN)
    exe = tmp_path / "engine-python"
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')  # drops `-m sglang.launch_server`
    exe.chmod(0o755)
    return exe


def recorded(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Pids a test started indirectly; whatever of them is left is killed afterwards."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
    return bool(out.strip()) and not out.strip().startswith("Z")


def engine_launcher(tiny_model: Path, tmp_path: Path, **engine: object) -> tuple[Launcher, httpx.AsyncClient]:
    port = free_port()
    settings = InferenceSettings(engine=EngineSettings(url=f"http://127.0.0.1:{port}", model=str(tiny_model),
                                                       boot_timeout_s=120, **engine))
    env = {**os.environ, "TANDEM_ENGINE__PORT": str(port), "TANDEM_ENGINE__MODEL": str(tiny_model),
           "OMP_NUM_THREADS": "1"}
    # a helper process in the engine's group stands in for SGLang's scheduler
    argv = ["sh", "-c", f"sleep 600 & exec {sys.executable} -m tandem_inference.engines.transformers"]
    http = httpx.AsyncClient()
    return Launcher(settings, http, argv=argv, env=env, log_path=tmp_path / "engine.log"), http


async def test_a_dead_engine_is_restarted_its_children_killed_and_the_controller_told(
    tiny_model: Path, tmp_path: Path
) -> None:
    launcher, http = engine_launcher(tiny_model, tmp_path)
    reloads: list[int] = []
    told: list[str] = []  # the controller hears the engine is down before the new one answers

    async def on_restart() -> None:
        reloads.append(1)
        told.append("restarted")

    launcher.on_restart = on_restart
    launcher.on_down = lambda: told.append("down")
    try:
        boot_s = await launcher.start()
        assert boot_s > 0
        first = launcher.proc.pid
        children = subprocess.run(["pgrep", "-g", str(first)], capture_output=True, text=True).stdout.split()
        orphan = next(int(p) for p in children if int(p) != first)
        supervisor = asyncio.create_task(launcher.supervise(poll_s=0.1))
        os.kill(first, 9)  # the engine crashes; its helper lives on
        for _ in range(600):
            if reloads:
                break
            await asyncio.sleep(0.1)
        assert reloads == [1]
        assert told == ["down", "restarted"]  # /ready says not ready in between (Controller.engine_lost)
        assert launcher.proc.pid != first
        assert (await http.get(f"{launcher.url}/health")).status_code == 200
        assert not alive(orphan), "the crashed engine's child process was left running"
        supervisor.cancel()
    finally:
        launcher.stop()
        await http.aclose()


async def test_restarts_are_bounded(tiny_model: Path, tmp_path: Path) -> None:
    launcher, http = engine_launcher(tiny_model, tmp_path, max_restarts=0)
    try:
        with pytest.raises(EngineBootError, match="giving up"):
            await launcher.restart("test")
    finally:
        launcher.stop()
        await http.aclose()


@contextmanager
def serving_service(stand_in: Path, tiny_model: Path, redis_url: str, tmp_path: Path, reap: list[int],
                    **extra_env: str) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """The inference service (`python -m tandem_inference.main`) with the stand-in as its engine,
    once its gateway serves: (the service, the engine's pid, the engine's record). Killed after."""
    record, log, gateway = tmp_path / "engine.record", tmp_path / "service.log", free_port()
    env = {**os.environ, "STAND_IN_RECORD": str(record), "TANDEM_ENGINE__KIND": "sglang",
           "TANDEM_ENGINE__SGLANG_PYTHON": str(stand_in), "TANDEM_ENGINE__URL": f"http://127.0.0.1:{free_port()}",
           "TANDEM_ENGINE__MODEL": str(tiny_model), "TANDEM_ENGINE__BOOT_TIMEOUT_S": "60",
           "TANDEM_GPUS__MODE": "cpu", "TANDEM_REDIS__URL": redis_url,
           "TANDEM_STORE__ROOT": str(tmp_path / "adapters"), "TANDEM_GATEWAY__PORT": str(gateway), **extra_env}
    with log.open("wb") as out:
        service = subprocess.Popen([sys.executable, "-m", "tandem_inference.main"], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    reap.append(service.pid)
    try:
        wait_until(lambda: recorded(record) or service.poll() is not None, 120, "the engine to start")
        engine = int(recorded(record)[0].split()[1])
        reap.append(engine)

        def serving() -> bool:
            assert service.poll() is None, log.read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{gateway}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(serving, 120, "the gateway to serve")
        yield service, engine, record
    finally:
        if service.poll() is None:
            service.kill()
            service.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_the_engine_ends_with_the_inference_service(
    sig: signal.Signals, stand_in: Path, tiny_model: Path, redis_url: str, tmp_path: Path, reap: list[int]
) -> None:
    with serving_service(stand_in, tiny_model, redis_url, tmp_path, reap) as (service, engine, record):
        os.kill(service.pid, sig)
        service.wait(60)
        wait_until(lambda: not alive(engine), 30, f"the engine to end after the service got {sig.name}")
        # SIGTERM and SIGINT: the service stopped the engine; SIGKILL: the kernel killed it
        expected = ["SIGTERM"] if sig != signal.SIGKILL else []
        assert recorded(record)[1:] == expected, recorded(record)
        assert not (tmp_path / "logs" / "sglang.pid").exists() or sig == signal.SIGKILL


def test_a_service_whose_engine_cannot_be_restarted_exits(
    stand_in: Path, tiny_model: Path, redis_url: str, tmp_path: Path, reap: list[int]
) -> None:
    with serving_service(stand_in, tiny_model, redis_url, tmp_path, reap,
                         TANDEM_ENGINE__MAX_RESTARTS="0") as (service, engine, _):
        os.kill(engine, signal.SIGKILL)  # and no restart is allowed
        wait_until(lambda: service.poll() is not None, 60, "the service to exit once its engine is gone for good")
        assert service.returncode != 0
        assert "giving up" in (tmp_path / "service.log").read_text()


def stand_in_launcher(stand_in: Path, tmp_path: Path, port: int, record: Path) -> tuple[Launcher, httpx.AsyncClient]:
    settings = InferenceSettings(engine=EngineSettings(kind="sglang", url=f"http://127.0.0.1:{port}",
                                                       sglang_python=str(stand_in), boot_timeout_s=60))
    # a helper process in the engine's group stands in for SGLang's scheduler
    argv = ["sh", "-c", f'sleep 600 & exec {stand_in} -m sglang.launch_server --port {port}']
    http = httpx.AsyncClient()
    launcher = Launcher(settings, http, argv=argv, env={**os.environ, "STAND_IN_RECORD": str(record)},
                        log_path=tmp_path / "engine.log", pid_path=tmp_path / "run" / "engine.pid")
    return launcher, http


def group_members(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
    return [int(p) for p, g, st in (line.split() for line in out.splitlines()) if int(g) == pgid and not st.startswith("Z")]


async def test_an_engine_left_by_a_previous_run_is_killed_before_a_new_one_starts(
    stand_in: Path, tmp_path: Path, reap: list[int]
) -> None:
    port = free_port()
    previous, http1 = stand_in_launcher(stand_in, tmp_path, port, tmp_path / "previous.record")
    current, http2 = stand_in_launcher(stand_in, tmp_path, port, tmp_path / "current.record")
    try:
        await previous.start()  # and never stopped: as if its service had died without a word
        group = previous.proc.pid
        reap.append(group)
        assert len(group_members(group)) == 2  # the engine and its helper
        assert json.loads((tmp_path / "run" / "engine.pid").read_text())["pid"] == group
        await current.start()
        reap.append(current.proc.pid)
        assert group_members(group) == [], "the previous engine's process group was left running"
        assert previous.proc.wait(10) == -signal.SIGKILL
        assert (await http2.get(f"http://127.0.0.1:{port}/health")).status_code == 200
        assert json.loads((tmp_path / "run" / "engine.pid").read_text())["pid"] == current.proc.pid
        current.stop()
        assert not (tmp_path / "run" / "engine.pid").exists()
    finally:
        current.stop()
        await http1.aclose()
        await http2.aclose()


def test_a_pid_file_naming_another_process_kills_nothing(stand_in: Path, tmp_path: Path, reap: list[int]) -> None:
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    reap.append(other.pid)
    launcher, _ = stand_in_launcher(stand_in, tmp_path, free_port(), tmp_path / "record")
    pid_file = tmp_path / "run" / "engine.pid"
    pid_file.parent.mkdir()
    pid_file.write_text(json.dumps({"pid": other.pid, "start_time": 1, "argv": ["python3", "-m", "sglang"]}))
    launcher.reap_leftover()
    assert other.poll() is None, "a process that only reuses the recorded pid was killed"
    assert not pid_file.exists()
    other.kill()
    other.wait(10)


async def test_a_port_in_use_by_another_process_is_named(stand_in: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        launcher, http = stand_in_launcher(stand_in, tmp_path, port, tmp_path / "record")
        try:
            with pytest.raises(EngineBootError, match=f"port {port} .* in use"):
                await launcher.start()
            assert launcher.proc is None
        finally:
            await http.aclose()
