"""Readiness probes for the local stack's services: each says whether its service answers yet.

A probe that is not answered says False (the supervisor asks again until the service is ready,
dies or runs out of time). A probe answered by a process that is not this stack's own -- another
stack started in the same moment on the same port -- raises StackError naming it: waiting longer
would not help, and the supervisor stops the stack.
"""

from __future__ import annotations

import subprocess

import httpx
import redis

from tandem.dev.ports import listens_on
from tandem.errors import StackError


def http_ok(url: str) -> bool:
    """GET `url` answers 200."""
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def redis_ready(url: str) -> bool:
    """The Redis at `url` answers a PING with these credentials."""
    try:
        with redis.Redis.from_url(url, socket_timeout=1) as conn:
            return bool(conn.ping())
    except redis.RedisError:  # not up yet: the probe's answer, not an error
        return False


def trainer_ready(redis_url: str) -> bool:
    """An rq worker has registered in the Redis at `redis_url`."""
    from rq import Worker

    try:
        with redis.Redis.from_url(redis_url, socket_timeout=2) as conn:
            return any(w.name for w in Worker.all(connection=conn))
    except redis.RedisError:  # Redis away: the trainer is not ready either
        return False


def engine_ready(url: str, admin_key: str) -> bool:
    """The engine this stack started answers at `url`: /health, and an admin call with this stack's
    `admin_key` (another stack's engine on the port refuses the key, so it is never taken for ours)."""
    if not http_ok(f"{url}/health"):
        return False
    try:
        reply = httpx.post(f"{url}/flush_cache", timeout=5.0, headers={"Authorization": f"Bearer {admin_key}"})
    except httpx.HTTPError:
        return False
    if reply.status_code in (401, 403):
        raise StackError(f"{url} answers with an engine that refuses this stack's admin key: another tandem "
                         "stack's engine holds the port; start this one again (it picks another port)")
    return reply.status_code == 200


def gateway_ready(port: int, proc: subprocess.Popen[bytes] | None) -> bool:
    """The gateway on `port` answers /ready -- and is the one `proc` runs: a stack started in the same
    moment on the same port would answer for it while ours cannot bind."""
    if not http_ok(f"http://127.0.0.1:{port}/ready"):
        return False
    if proc is not None and listens_on(proc.pid, port) is False:
        raise StackError(f"gateway port {port} is held by another process (another `tandem up` started at the "
                         "same time?), which answered for this stack; stop it, or start this stack with "
                         "`tandem up --gateway-port 0` (a free port)")
    return True
