"""The per-run lock: two workers never train one run at once.

A SET NX PX key per run (`keys.run_lock`), whose value is `<owner>|<nonce>`. The owner is a
worker's liveness token, so a worker that finds the lock held asks whether its holder still
lives (`holder_alive`, answered by recovery.py from the liveness keys) and takes over at once
from a dead one, instead of waiting out the lock's TTL behind a worker killed while training.
Every Redis error is raised as `BackendUnavailable`, naming the lock and the Redis URL.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import redis

from tandem import keys
from tandem.connection import text, translated
from tandem_trainer.errors import LockTimeout

log = logging.getLogger(__name__)

_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
_STEAL = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3]) end return false"
)


class RunLock:
    """SET NX PX lock on one run; a holder whose worker is gone is taken over at once."""

    def __init__(
        self, conn: redis.Redis, run: str, owner: str, holder_alive: Callable[[str], bool]
    ) -> None:
        self.conn, self.key, self.holder_alive = conn, keys.run_lock(run), holder_alive
        self.value = f"{owner}|{uuid.uuid4().hex[:12]}"

    def acquire(self, ttl_ms: int, wait_s: float) -> None:
        """Take the lock for `ttl_ms`, waiting up to `wait_s` for a live holder to let go."""
        deadline, pause = time.monotonic() + wait_s, 0.05
        while True:
            with translated(self.conn, f"take the run lock {self.key}"):
                if self.conn.set(self.key, self.value, nx=True, px=ttl_ms):
                    return
                raw = self.conn.get(self.key)
            held = None if raw is None else text(raw)
            if held == self.value:
                return  # our own SET went through; its reply was lost to a dropped connection
            if held is not None and not self.holder_alive(held.split("|")[0]):
                with translated(self.conn, f"take over the run lock {self.key}"):
                    stolen = self.conn.eval(_STEAL, 1, self.key, held, self.value, ttl_ms)
                if stolen:
                    log.warning("run lock %s taken over from dead holder %s", self.key, held)
                    return
            if time.monotonic() > deadline:
                raise LockTimeout(f"{self.key} stayed held by {held!r} for {wait_s:.0f}s; retry later")
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def release(self) -> None:
        """Delete the lock if it is still ours (it may have expired and been taken since)."""
        with translated(self.conn, f"release the run lock {self.key}"):
            self.conn.eval(_RELEASE, 1, self.key, self.value)
