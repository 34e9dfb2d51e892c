"""The engine the hot-load scenario measures: one engine process on a free low port, started and
stopped as tandem's launcher does, with its engine client.

A stop waits until every process of the engine's group is gone (SGLang's children hold GPU
memory until then); a start first checks that the port is still free, and moves to another
one when some other process took it while the engine was down.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tandem.dev.ports import port_free

ENGINE_PORTS = (30000, 31000)  # SGLang derives more ports from its own and refuses high ones


class Engine:
    """One engine process on a free low port, started and stopped as tandem's launcher does."""

    def __init__(self, ctx: Any, http: Any, max_rank: int) -> None:
        self.ctx, self.http, self.max_rank = ctx, http, max_rank
        self._configure(free_low_port())

    def _configure(self, port: int) -> None:
        from tandem.settings import InferenceSettings
        from tandem_inference.engines import connect
        from tandem_inference.engines.launcher import Launcher
        from tandem_inference.engines.sglang_launcher import sglang_argv, sglang_env
        from tandem_inference.engines.vllm_launcher import vllm_argv, vllm_env

        ctx, http, max_rank = self.ctx, self.http, self.max_rank
        self.port = port
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONUNBUFFERED": "1"})
        if ctx.engine == "transformers":  # one torch thread, as the local stack runs it
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("MKL_NUM_THREADS", "1")
        env.update(ctx.engine_env)
        env.update({
            "TANDEM_ENGINE__KIND": ctx.engine,
            "TANDEM_ENGINE__MODEL": str(ctx.model),
            "TANDEM_ENGINE__URL": f"http://127.0.0.1:{port}",
            "TANDEM_ENGINE__HOST": "127.0.0.1",
            "TANDEM_ENGINE__PORT": str(port),
            "TANDEM_ENGINE__SGLANG_PYTHON": ctx.sglang_python,
            "TANDEM_ENGINE__VLLM_PYTHON": ctx.vllm_python,
            # the engine loads only from its roots: the store's versions or the random adapters in
            # `out`, and the merged checkpoints in `out`
            "TANDEM_ENGINE__ADAPTER_ROOTS": json.dumps([str(Path(ctx.store_root).resolve()), str(Path(ctx.out).resolve())]),
            "TANDEM_ENGINE__WEIGHTS_ROOTS": json.dumps([str(Path(ctx.out).resolve()), str(Path(ctx.model).resolve().parent)]),
        })
        with environ(env):
            settings = InferenceSettings(_env_file=None)  # type: ignore[call-arg]
        if max_rank > settings.engine.max_lora_rank:
            if not hasattr(self, "launcher"):
                ctx.progress(f"hotload: adapters have rank {max_rank} > engine.max_lora_rank "
                             f"{settings.engine.max_lora_rank}; starting the engine with {max_rank}")
            env["TANDEM_ENGINE__MAX_LORA_RANK"] = str(max_rank)
            with environ(env):
                settings = InferenceSettings(_env_file=None)  # type: ignore[call-arg]
        if ctx.engine == "sglang":
            argv, env = sglang_argv(settings), sglang_env(settings, base=env)
        elif ctx.engine == "vllm":
            argv, env = vllm_argv(settings), vllm_env(settings, base=env)
        else:
            argv = [ctx.tandem_python, "-m", "tandem_inference.engines.transformers"]
        self.log_path = Path(ctx.out) / "hotload-engine.log"
        self.launcher = Launcher(settings, http, argv=argv, env=env, log_path=self.log_path, health_poll_s=0.05)
        self.client = connect(settings.engine, http)

    async def start(self) -> float:
        """Start the engine and wait until /health answers; returns seconds.

        The port is checked first: when another process took it while the engine was down, the
        engine moves to another free one (its /health would otherwise answer for this engine).
        """
        t0 = time.perf_counter()
        if not port_free(self.port):
            moved = free_low_port()
            self.ctx.progress(f"hotload: port {self.port} was taken while the engine was down; using {moved}")
            self._configure(moved)
        await self.launcher.start()
        return time.perf_counter() - t0

    def stop(self) -> float:
        """Stop the engine's whole process group and wait until every process of it is gone."""
        t0 = time.perf_counter()
        proc = self.launcher.proc
        self.launcher.terminate()
        if proc is not None:
            wait_group_gone(proc.pid, timeout_s=60.0)
        return time.perf_counter() - t0


@contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """os.environ replaced by `env` for the block: settings are read from the environment."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def free_low_port() -> int:
    """A free port in ENGINE_PORTS, picked at random: other tandem stacks take the lowest free one."""
    ports = list(range(*ENGINE_PORTS))
    random.shuffle(ports)
    for port in ports:
        if port_free(port):
            return port
    raise RuntimeError(f"no free port in {ENGINE_PORTS[0]}-{ENGINE_PORTS[1]} for the engine")


def wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no live process is left in the group (SGLang's children hold GPU memory until then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not group_members(pgid):
            return
        time.sleep(0.05)
    for pid in group_members(pgid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc; elsewhere, whether killpg finds any."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members
