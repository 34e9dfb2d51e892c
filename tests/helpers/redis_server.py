"""A redis-server of a test's own: on a free port, in its own directory, stopped and started at will.

The session's shared server (tests/conftest.py) and the tests that take Redis away from a
worker or a client both start theirs here. A durable server fsyncs its append-only file on
every write, so a stop (SIGTERM) and a start on the same port and directory bring back every
key: the queue, the registry, the events. With `roles`, it has the Redis user of each role
(tandem.acl) beside its admin (`url`), when it is Redis 7 or newer: `role_urls` are theirs
(each the admin's on an older Redis, which has no selectors).
"""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import pytest
import redis

from helpers.loopback import free_port
from tandem.acl import MIN_REDIS_VERSION, Role, role_url, user_lines
from tandem.dev.composition import redis_server_binary, redis_server_version


class RedisServer:
    """One redis-server process on loopback; `url` carries the password when there is one."""

    def __init__(self, workdir: Path, *, password: str | None = None, durable: bool = True,
                 roles: bool = False) -> None:
        self.dir, self.port, self.password, self.durable = workdir, free_port(), password, durable
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.roles = roles and redis_server_version(redis_server_binary()) >= MIN_REDIS_VERSION
        """Whether it has the user of each role (asked for, and Redis 7 or newer)."""
        self.role_passwords = {role: secrets.token_hex(16) for role in Role}
        self.role_urls = {role: role_url(self.url, role, self.role_passwords[role]) if self.roles else self.url
                          for role in Role}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        """Start it and wait until it answers PING (fails the test after 20 s)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        auth = ["--requirepass", self.password] if self.password else []
        conf = self.dir / "users.conf"  # the users' passwords on no command line; DEBUG and MODULE reach the ACL check
        conf.write_text("".join(f"{line}\n" for line in (
            ["enable-debug-command yes", "enable-module-command yes", *user_lines(self.role_passwords)] if self.roles else [])))
        self.proc = subprocess.Popen(
            [redis_server_binary(), str(conf), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
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


def refusals(conn: redis.Redis) -> list[str]:
    """What Redis refused any user since its ACL log was last reset (`conn` is the admin's), one line each."""
    return [f"{e['username']}: {e['reason']} {e['object']} ({e['context']})" for e in conn.acl_log(count=50)]


def assert_no_refusals(url: str) -> None:
    """Fail when the Redis at `url` (the admin's) refused a role's user anything: what its service
    did, its role must allow."""
    with redis.Redis.from_url(url) as conn:
        refused = refusals(conn)
    assert not refused, f"Redis refused a role's user what its service asked: {refused}"
