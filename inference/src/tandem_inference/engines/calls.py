"""What a call to the engine is: its kind, its timeout, whether it is retried, the pool it uses.

Each call kind has its own timeout (a load may take a minute, a health check must not), and
only idempotent calls are retried, only after connection errors, a bounded number of times:
`should_retry` is the one place that decides. A metrics call is read once, short and bounded in
size: the scraper's next scrape is its retry. Generation and the rest travel in separate
connection pools (`pool_limits`), so loads, unloads and health checks never queue behind
rollouts.
"""

from __future__ import annotations

from enum import StrEnum

import httpx

#: Attempts of one retryable call (the first try included).
MAX_ATTEMPTS = 3
#: Pause before the second attempt, in seconds; doubles each attempt, capped at RETRY_MAX_PAUSE_S.
RETRY_PAUSE_S = 0.2
RETRY_MAX_PAUSE_S = 2.0
#: Timeout of health, info and cache calls, in seconds.
INFO_TIMEOUT_S = 10.0
#: Timeout of reading the engine's metrics, start to end, in seconds: within a Prometheus scrape's
#: own timeout (10 s by default), so a slow engine is a failed scrape, not a hung one.
METRICS_TIMEOUT_S = 5.0
#: Most bytes of the engine's metrics read (SGLang's and vLLM's run to a few hundred kB); an engine
#: that answers more is refused before its text costs more memory.
METRICS_MAX_BYTES = 4 * 1024 * 1024
#: Longest wait for a TCP connection, in seconds (the engine is on a private network).
CONNECT_TIMEOUT_S = 10.0
#: Connections of the admin pool (loads, unloads, health, info, and one metrics read at a time).
ADMIN_CONNECTIONS = 8


def pool_limits(max_calls: int) -> httpx.Limits:
    """Limits of a pool with room for `max_calls` calls at once, each on a connection of its own.

    Size the generation pool for every call the gateway admits: a call that waits for a
    connection costs the pool time on every later call (httpcore rescans its queue), so a deep
    queue there stalls the whole process.
    """
    return httpx.Limits(max_connections=max_calls, max_keepalive_connections=max_calls)


class CallKind(StrEnum):
    """What a call does; picks its timeout, its auth and whether it may be retried."""

    GENERATE = "generate"
    LOAD = "load"
    UNLOAD = "unload"
    INFO = "info"
    FLUSH = "flush"
    MEMORY = "memory"
    WEIGHTS = "weights"
    METRICS = "metrics"


#: Calls that change nothing when repeated. A load is not (a second load under the same
#: name is refused), nor is an unload or a memory release. A metrics call changes nothing
#: either, but it makes one attempt (`HttpEngine._text`): retries would outlast the scrape.
IDEMPOTENT = frozenset({CallKind.GENERATE, CallKind.INFO, CallKind.FLUSH})

#: httpx errors that mean "the connection failed", not "the engine was slow": a read
#: timeout on a generation is not retried, it would only double the wait.
CONNECTION_ERRORS: tuple[type[httpx.HTTPError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


def should_retry(
    kind: CallKind, exc: BaseException, attempt: int, *, max_attempts: int = MAX_ATTEMPTS
) -> bool:
    """Whether attempt number `attempt` (1-based) of a `kind` call that raised `exc` is retried."""
    return attempt < max_attempts and kind in IDEMPOTENT and isinstance(exc, CONNECTION_ERRORS)


def retry_pause_s(attempt: int) -> float:
    """Pause after failed attempt number `attempt`, in seconds."""
    return float(min(RETRY_MAX_PAUSE_S, RETRY_PAUSE_S * 2 ** (attempt - 1)))
