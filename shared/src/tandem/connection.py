"""Where tandem meets Redis: naming a connection, translating its errors, riding out outages,
reading its replies as text.

Every Redis error that reaches tandem code becomes `BackendUnavailable`, with a message that
names the Redis URL (never its password) and what to do. Whether a failed call is worth
repeating is decided in one place, `retryable`: a refused or dropped connection, a timeout
and a Redis still loading its data after a restart are; a wrong password, a missing
permission or a command Redis refuses are not, because repeating them cannot help.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import redis
from redis.exceptions import AuthenticationError, AuthorizationError, NoPermissionError

from tandem.errors import BackendUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

#: First pause after a failed call, in seconds; it doubles up to `RETRY_MAX_PAUSE_S`.
RETRY_FIRST_PAUSE_S = 0.1
#: Longest pause between two tries, in seconds.
RETRY_MAX_PAUSE_S = 2.0

#: What to do when Redis does not answer; the end of every `BackendUnavailable` about Redis.
ADVICE = "start Redis (`tandem up` or the stack's redis service) or point TANDEM_REDIS__URL at it"

#: What to do when Redis refuses a command to the user of the URL (NOPERM, tandem.acl).
ROLE_ADVICE = ("its Redis user may not do that: give this service its own role's URL in TANDEM_REDIS__URL "
               "(docs/operations.md, \"Redis roles and what each may do\")")


def redis_url(conn: redis.Redis) -> str:
    """The URL `conn` talks to, without username or password."""
    kwargs = conn.connection_pool.connection_kwargs
    db = kwargs.get("db", 0)
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={db}"
    scheme = "rediss" if issubclass(conn.connection_pool.connection_class, redis.SSLConnection) else "redis"
    return f"{scheme}://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"


def text(raw: bytes | str) -> str:
    """A Redis reply as text.

    tandem's connections answer bytes (`decode_responses=False`), because the same connection
    carries rq's jobs, whose hashes hold bytes that are not text; tandem's own keys hold UTF-8.
    """
    return raw.decode() if isinstance(raw, bytes) else raw


def unavailable(conn: redis.Redis, action: str, exc: redis.RedisError) -> BackendUnavailable:
    """The error to raise when `action` (e.g. "read run 'r'") failed with `exc`."""
    if isinstance(exc, NoPermissionError):
        return BackendUnavailable(f"cannot {action}: Redis at {redis_url(conn)} refused it ({exc}); {ROLE_ADVICE}")
    return BackendUnavailable(f"cannot {action}: Redis at {redis_url(conn)} failed ({exc}); {ADVICE}")


@contextmanager
def translated(conn: redis.Redis, action: str) -> Iterator[None]:
    """Re-raise a Redis error from the block as `BackendUnavailable` naming `action` and the URL."""
    try:
        yield
    except redis.RedisError as exc:
        raise unavailable(conn, action, exc) from exc


def retryable(exc: BaseException) -> bool:
    """True when trying the same call again later may succeed (Redis down, restarting or slow).

    `BackendUnavailable` is judged by the Redis error it was raised from.
    """
    if isinstance(exc, BackendUnavailable):
        cause = exc.__cause__
        return cause is not None and retryable(cause)
    if isinstance(exc, AuthenticationError | AuthorizationError):
        return False
    return isinstance(exc, redis.ConnectionError | redis.TimeoutError)


def call_until(deadline: float, call: Callable[[], T], *, what: str) -> T:
    """`call()`, tried again with growing pauses while it fails with a `retryable` error.

    Bounded by `deadline` (time.monotonic): once it passes, the last error is raised as it is.
    """
    pause = RETRY_FIRST_PAUSE_S
    failed_since: float | None = None
    while True:
        try:
            result = call()
        except Exception as exc:
            now = time.monotonic()
            if not retryable(exc) or now >= deadline:
                raise
            if failed_since is None:
                failed_since = now
                log.warning("%s: Redis unavailable (%s); retrying until the deadline", what, exc)
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, RETRY_MAX_PAUSE_S)
            continue
        if failed_since is not None:
            log.info("%s: Redis answers again after %.1f s", what, time.monotonic() - failed_since)
        return result
