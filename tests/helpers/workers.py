"""Trainer worker processes (`python -m tandem_trainer.main`) for the tests that run the real worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.dev.ports import free_port


class WorkerProcess:
    """One trainer worker subprocess; its output goes to a log file shown on failure."""

    def __init__(self, redis_url: str, store_root: Path, log_path: Path, env: dict[str, str] | None = None) -> None:
        env = {
            **os.environ,
            "TANDEM_REDIS__URL": redis_url,
            "TANDEM_STORE__ROOT": str(store_root),
            "TANDEM_BACKEND__DEVICE": os.environ.get("TANDEM_TEST_TRAINER_DEVICE", "cpu"),
            "TANDEM_METRICS__PORT": str(free_port()),
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.metrics_url = f"http://127.0.0.1:{env['TANDEM_METRICS__PORT']}/metrics"
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_trainer.main"], env=env, cwd=store_root.parent,
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def listening_on(self) -> set[str]:
        """The addresses this trainer's processes (with several ranks: torchrun's and the ranks')
        listen on."""
        import psutil

        main = psutil.Process(self.proc.pid)
        return {conn.laddr.ip for proc in [main, *main.children(recursive=True)]
                for conn in proc.net_connections(kind="tcp") if conn.status == psutil.CONN_LISTEN}

    def wait_listening(self, timeout_s: float = 90) -> None:
        """Until rq listens on the queue (recovery at start-up is done by then)."""
        wait_for(lambda: "Listening on" in self.log(), timeout_s, "the worker to listen", self)

    def wait_dead(self, timeout_s: float = 120) -> int:
        """Until the process ends by itself (a failpoint's SIGKILL); returns its exit status."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker still alive after {timeout_s}s:\n{self.log()[-6000:]}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def start_workers(redis_url: str, root: Path, logs: Path) -> tuple[Callable[..., WorkerProcess], list[WorkerProcess]]:
    """A factory of worker processes sharing one Redis and one store, and the list it fills."""
    started: list[WorkerProcess] = []

    def start(env: dict[str, str] | None = None) -> WorkerProcess:
        w = WorkerProcess(redis_url, root, logs / f"worker-{len(started)}.log", env)
        started.append(w)
        return w

    return start, started


def stop_workers(started: list[WorkerProcess]) -> None:
    for w in started:
        w.stop()
        print(f"--- {w.log_path.name} ---\n{w.log()[-6000:]}")


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, worker: WorkerProcess) -> None:
    """Until `predicate` holds; fails at once, with the worker's log, when the worker exits first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if worker.proc.poll() is not None:
            pytest.fail(f"worker exited ({worker.proc.returncode}) while waiting for {what}:\n{worker.log()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}:\n{worker.log()[-6000:]}")
        time.sleep(0.1)
