"""The launcher supervises a real engine process: restart on death, reload, no orphans left."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from loopback import free_port

from tandem.settings import EngineSettings, InferenceSettings
from tandem_inference.launcher import EngineBootError, Launcher

pytestmark = pytest.mark.integration


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
    argv = ["sh", "-c", f"sleep 600 & exec {sys.executable} -m tandem_inference.engine_server"]
    http = httpx.AsyncClient()
    return Launcher(settings, http, argv=argv, env=env, log_path=tmp_path / "engine.log"), http


async def test_a_dead_engine_is_restarted_its_children_killed_and_the_controller_told(
    tiny_model: Path, tmp_path: Path
) -> None:
    launcher, http = engine_launcher(tiny_model, tmp_path)
    reloads: list[int] = []

    async def on_restart() -> None:
        reloads.append(1)

    launcher.on_restart = on_restart
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
