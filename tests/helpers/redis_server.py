"""A redis-server of a test's own: on a free port, in its own directory, stopped and started at will.

The session's shared server (tests/conftest.py) and the tests that take Redis away from a
worker or a client both start theirs here. A durable server fsyncs its append-only file on
every write, so a stop (SIGTERM) and a start on the same port and directory bring back every
key: the queue, the registry, the events.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis

from helpers.loopback import free_port
from tandem.dev.stack import redis_server_binary


class RedisServer:
    """One redis-server process on loopback; `url` carries the password when there is one."""

    def __init__(self, workdir: Path, *, password: str | None = None, durable: bool = True) -> None:
        self.dir, self.port, self.password, self.durable = workdir, free_port(), password, durable
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        """Start it and wait until it answers PING (fails the test after 20 s)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", *persistence, *auth],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with redis.Redis.from_url(self.url, socket_timeout=1) as probe:
                    probe.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.proc.kill()
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (a durable server syncs its append-only file first), then wait for the exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)

    def connect(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)
