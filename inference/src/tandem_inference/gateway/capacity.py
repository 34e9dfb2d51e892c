"""Admission control of the gateway: a bounded amount of generation in flight, a bounded queue.

A request costs its `n` samples (sequences) and the tokens they may generate (`n * max_tokens`).
It is admitted while both fit in the budget (`gateway.max_in_flight_sequences`,
`gateway.max_in_flight_tokens`); otherwise it waits in a queue of at most
`gateway.max_queued_requests` requests for at most `gateway.queue_timeout_s`, and is refused
(`Overloaded`, HTTP 429 with Retry-After) when the queue is full or the wait runs out.

As room frees, waiting requests are admitted smallest first (by tokens, then in arrival order),
so a small request is not held behind large ones: the engine's backlog, not the queue, is what
it waits for. For the same reason a full queue keeps its smallest requests: a newcomer smaller
than the largest waiter takes that one's place, and that one is refused.

So that large requests are not passed over for ever, the oldest waiter, once it has waited half
of `gateway.queue_timeout_s` (it is overdue), may be passed only by smaller requests, and only by
as many of their tokens as its own (the whole token budget at most: its allowance). When the
allowance is spent, no one else is admitted until it fits, which it does once the work in flight
ends at the latest; then the next oldest, if overdue, has an allowance of its own. An overdue
request is therefore admitted once the work in flight when it turned overdue, and the smaller
requests admitted past it (its allowance's worth at most), have ended, if not before; and a
steady supply of overdue large requests cannot hold small ones back: each lets its allowance of
them pass first (holding all others back until it fit made a 4-token request wait 15 s and more
behind a queue of large ones). A request larger than the whole budget
is admitted once nothing else is in flight: it runs alone rather than never.

Only generation is counted here: /health, /ready, /metrics and the controller's engine calls
never wait for room. Everything runs on the event loop, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.settings import GatewaySettings
from tandem_inference.errors import Overloaded


@dataclass(frozen=True)
class Cost:
    """What one request may hold at the engine: its samples and the tokens they may generate."""

    sequences: int
    tokens: int


@dataclass(eq=False)
class _Waiter:
    cost: Cost
    admitted: asyncio.Future[None]
    since: float
    """When it started to wait (the capacity's clock)."""
    passed_by: int = 0
    """Tokens of smaller requests admitted past it while it was overdue: at most its allowance."""


@dataclass(eq=False)
class Permit:
    """Room held by one admitted request until `release()` (idempotent)."""

    capacity: Capacity
    cost: Cost
    waited_s: float = 0.0
    """How long the request waited in the queue, in seconds."""
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.capacity._give_back(self.cost)


class Capacity:
    """The gateway's budget of generation in flight, and the queue in front of it."""

    def __init__(self, *, max_sequences: int, max_tokens: int, max_queued: int, queue_timeout_s: float,
                 retry_after_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        """Seconds from any origin: when a waiter is overdue, how long a request waited."""
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.sequences = 0
        """Samples admitted and not yet released."""
        self.tokens = 0
        """Tokens admitted (n * max_tokens of each request) and not yet released."""
        self.requests = 0
        """Requests admitted and not yet released."""
        self._waiters: deque[_Waiter] = deque()

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> Capacity:
        return cls(max_sequences=settings.max_in_flight_sequences, max_tokens=settings.max_in_flight_tokens,
                   max_queued=settings.max_queued_requests, queue_timeout_s=settings.queue_timeout_s,
                   retry_after_s=settings.retry_after_s)

    @property
    def queued(self) -> int:
        """Requests waiting for room now."""
        return len(self._waiters)

    @property
    def oldest_wait_s(self) -> float:
        """How long the oldest waiting request has waited so far, in seconds (0 when none waits)."""
        return self.clock() - self._waiters[0].since if self._waiters else 0.0

    async def acquire(self, sequences: int, tokens: int) -> Permit:
        """Room for a request of `sequences` samples and `tokens` tokens, or Overloaded.

        Cancelling the wait (the client left) leaves the queue and holds nothing.
        """
        cost = Cost(sequences, tokens)
        overdue = self._overdue()
        if self._fits(cost) and self._may_pass(cost, overdue):
            self._take(cost, past=overdue)
            return Permit(self, cost)
        if len(self._waiters) >= self.max_queued and not self._make_room_for(cost):
            raise Overloaded(
                f"the gateway is at capacity ({self._load()}) and {len(self._waiters)} requests already wait "
                f"(gateway.max_queued_requests={self.max_queued}); retry after {self.retry_after_s} s",
                reason="queue_full", retry_after_s=self.retry_after_s)
        t0 = self.clock()
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = _Waiter(cost, admitted, t0)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(admitted), self.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            refused = admitted.exception() if admitted.done() and not admitted.cancelled() else None
            if not admitted.done():
                self._waiters.remove(entry)
                admitted.cancel()
                self._admit_waiting()  # it may have held the others back
            elif refused is None:  # admitted just as the wait ended
                if isinstance(exc, TimeoutError):
                    return Permit(self, cost, self.clock() - t0)
                self._give_back(cost)  # but the request is gone
            elif isinstance(exc, TimeoutError):  # refused for a smaller request just as the wait ended
                raise refused from None
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Overloaded(
                f"the gateway is at capacity ({self._load()}); this request waited "
                f"{self.queue_timeout_s:g} s (gateway.queue_timeout_s) without room; retry after "
                f"{self.retry_after_s} s", reason="queue_timeout", retry_after_s=self.retry_after_s) from None
        return Permit(self, cost, self.clock() - t0)

    def _fits(self, cost: Cost) -> bool:
        if self.requests == 0:
            return True  # alone, any request runs (even one larger than the whole budget)
        return (self.sequences + cost.sequences <= self.max_sequences
                and self.tokens + cost.tokens <= self.max_tokens)

    def _take(self, cost: Cost, past: _Waiter | None = None) -> None:
        """Hold `cost`, admitted before the overdue waiter `past` (if any): that spends its allowance."""
        if past is not None:
            past.passed_by += cost.tokens
        self.sequences += cost.sequences
        self.tokens += cost.tokens
        self.requests += 1

    def _make_room_for(self, cost: Cost) -> bool:
        """Refuse the largest waiter (the newest among equals) if `cost` is smaller; False if none is."""
        overdue = self._overdue()
        largest = max((w for w in reversed(self._waiters) if w is not overdue), key=lambda w: w.cost.tokens,
                      default=None)
        if largest is None or largest.cost.tokens <= cost.tokens:
            return False
        self._waiters.remove(largest)
        largest.admitted.set_exception(Overloaded(
            f"the gateway is at capacity ({self._load()}) and its queue (gateway.max_queued_requests="
            f"{self.max_queued}) is full; smaller requests took this one's place; retry after "
            f"{self.retry_after_s} s", reason="queue_full", retry_after_s=self.retry_after_s))
        return True

    def _overdue(self) -> _Waiter | None:
        """The oldest waiter if it has waited half its time: then only its allowance may pass it."""
        if self._waiters and self.clock() - self._waiters[0].since >= self.queue_timeout_s / 2:
            return self._waiters[0]
        return None

    def _may_pass(self, cost: Cost, overdue: _Waiter | None) -> bool:
        """Whether a request of `cost` may be admitted before the `overdue` waiter (any may when none is):
        only a smaller one, and only within the overdue one's allowance."""
        if overdue is None:
            return True
        allowance = min(overdue.cost.tokens, self.max_tokens)
        return cost.tokens < overdue.cost.tokens and overdue.passed_by + cost.tokens <= allowance

    def _give_back(self, cost: Cost) -> None:
        self.sequences -= cost.sequences
        self.tokens -= cost.tokens
        self.requests -= 1
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        """Admit the waiters that fit, smallest first; past an overdue one only within its allowance."""
        while True:
            overdue = self._overdue()
            for waiter in sorted(self._waiters, key=lambda w: w.cost.tokens):  # stable: arrival order among equals
                if waiter is overdue:  # the ones after it are no smaller and arrived later
                    if not self._fits(waiter.cost):
                        return
                    self._admit(waiter)
                    break  # the next oldest may be overdue: start over with it
                if self._fits(waiter.cost) and self._may_pass(waiter.cost, overdue):
                    self._admit(waiter, past=overdue)
            else:
                return

    def _admit(self, waiter: _Waiter, past: _Waiter | None = None) -> None:
        self._waiters.remove(waiter)
        self._take(waiter.cost, past)
        waiter.admitted.set_result(None)

    def _load(self) -> str:
        return (f"{self.sequences} of {self.max_sequences} sequences (gateway.max_in_flight_sequences) and "
                f"{self.tokens} of {self.max_tokens} tokens (gateway.max_in_flight_tokens) in flight")
