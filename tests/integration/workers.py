"""Trainer worker processes and a Redis server of a test's own, for the integration tests
that run the real worker (`python -m tandem_trainer.main`)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from loopback import free_port
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem.jobs import TrainJob
from tandem.stack import redis_server_binary

RUN = "worker-run"


class WorkerProcess:
    """One trainer worker subprocess; its output goes to a log file shown on failure."""

    def __init__(self, redis_url: str, store_root: Path, log_path: Path, env: dict[str, str] | None = None) -> None:
        env = {
            **os.environ,
            "TANDEM_REDIS__URL": redis_url,
            "TANDEM_STORE__ROOT": str(store_root),
            "TANDEM_BACKEND__DEVICE": os.environ.get("TANDEM_TEST_TRAINER_DEVICE", "cpu"),
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_trainer.main"], env=env, cwd=store_root.parent,
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

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


class RedisServer:
    """A redis-server of a test's own, on its own port, that the test may stop and start again.

    Its append-only file is fsynced on every write, so a stop (SIGTERM) and a start on the
    same port and directory bring back every key: the queue, the registry, the events.
    """

    def __init__(self, workdir: Path) -> None:
        self.dir, self.port = workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url, socket_timeout=1).ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis-server syncs its append-only file, then exits
            self.proc.wait(20)

    def connect(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


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
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if worker.proc.poll() is not None:
            pytest.fail(f"worker exited ({worker.proc.returncode}) while waiting for {what}:\n{worker.log()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}:\n{worker.log()[-6000:]}")
        time.sleep(0.1)


def status(conn, job_id: str) -> JobStatus | None:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status()


def make_job(job_id: str, *, groups: int = 2, size: int = 4, prompt: int = 6, completion: int = 8,
             seed: int = 0, run: str = RUN) -> TrainJob:
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        p = [rng.randrange(3, 500) for _ in range(prompt)]
        out.append({"trajectories": [
            {"prompt_ids": p, "completion_ids": [rng.randrange(3, 500) for _ in range(completion)],
             "rollout_logprobs": [-6.2] * completion, "reward": rng.random()}
            for _ in range(size)
        ]})
    return TrainJob.model_validate({"job_id": job_id, "run": run, "step": 1, "groups": out, "timeout_s": 300})
