"""A bounded wait for a condition, for tests that watch another thread or process get somewhere."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object],
    timeout_s: float = 60.0,
    what: str = "condition",
    *,
    interval_s: float = 0.05,
    ignoring: tuple[type[Exception], ...] = (),
) -> None:
    """Poll `predicate` until it is truthy; AssertionError naming `what` after `timeout_s`.

    Exceptions of the types in `ignoring` count as "not yet" (a service that is restarting
    answers with errors); any other exception ends the wait.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except ignoring:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
