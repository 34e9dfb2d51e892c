"""How the trainer rides out a Redis outage: every command waits for Redis, up to a bound.

A job that ends while Redis is away (a restart, a failover, a network cut) must still
register its version, announce it and let rq record the result once Redis is back. The
trainer's part of that is tandem's own code, but rq's bookkeeping around a job (heartbeats,
the started registry, the result) runs on the same connection, and an error there makes rq's
worker quit. So the retry sits on the connection itself: redis-py's `Retry` policy, with
tandem's one predicate (`tandem.connection.retryable`) deciding what is worth repeating and a
deadline bounding how long. A wrong password or a refused command still fails at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tandem.connection import RETRY_FIRST_PAUSE_S, RETRY_MAX_PAUSE_S, retryable

log = logging.getLogger(__name__)

T = TypeVar("T")


class OutageRetry(Retry):
    """Retry a failed Redis call with growing pauses while Redis may come back, for `outage_s`.

    redis-py nests retries (a command retries its connect, which retries too); a deadline per
    call, rather than a count, keeps the nested total near `outage_s` instead of its square.
    """

    def __init__(self, outage_s: float) -> None:
        super().__init__(ExponentialBackoff(cap=RETRY_MAX_PAUSE_S, base=RETRY_FIRST_PAUSE_S / 2), retries=-1)
        self.outage_s = outage_s

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        deadline = time.monotonic() + self.outage_s
        failures = 0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if not retryable(error) or (is_retryable is not None and not is_retryable(error)):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if failures == 1:
                    log.warning("redis.unavailable error=%s: retrying for up to %.0f s", error, left)
                time.sleep(min(self._backoff.compute(failures), left))


def ride_out_outages(conn: redis.Redis, outage_s: float) -> redis.Redis:
    """Make every command on `conn` wait out a Redis outage of up to `outage_s`; returns `conn`."""
    conn.set_retry(OutageRetry(outage_s))
    return conn
