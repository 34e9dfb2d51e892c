"""Each run's quota of rollouts in flight: a run's burst waits for its own turn, not for the others'.

The gateway's capacity (capacity.py) bounds the generation of all runs together. Without more,
one run that sends a thousand requests at once fills its queue, and every other run's requests
wait behind them or are refused with `queue_full`. So before a request of a run reaches the
capacity it takes a turn of its run: a run holds at most `gateway.run_max_in_flight_sequences`
samples (each request's `n`) between this gate and its reply, queued at the capacity or
generating. A request beyond its run's quota waits here, in its run's own line (first come, first
served: a run's requests keep their order), and holds nothing the other runs need; it is let in
as the run's own requests end.

Work beyond the quota is queued, not refused. Only two things refuse it, each with 429, a
Retry-After and a message that names the quota and the setting to raise:
- a wait longer than `gateway.run_queue_timeout_s` (`run_quota_timeout`);
- more than `gateway.run_max_queued_requests` of one run's requests already waiting
  (`run_queue_full`): a bound on what one run may park in the gateway's memory.

A request of more samples than the whole quota is let in once its run has nothing in flight: it
runs alone rather than never. The base model is no run: its requests are bounded by the capacity
only. Everything runs on the event loop, so no lock is needed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from tandem.settings import GatewaySettings
from tandem_inference.errors import Overloaded


@dataclass(eq=False)
class _Waiter:
    sequences: int
    admitted: asyncio.Future[None]


@dataclass(eq=False)
class RunPermit:
    """A run's turn held by one request until `release()` (idempotent)."""

    quotas: RunQuotas | None
    run: str
    sequences: int
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released and self.quotas is not None:
            self._released = True
            self.quotas._give_back(self.run, self.sequences)


def unbounded() -> RunPermit:
    """The permit of a request that takes no run's turn (the base model's): releasing it does nothing."""
    return RunPermit(None, "", 0)


class RunQuotas:
    """Every run's samples in flight, bounded per run, and the runs' lines of waiting requests."""

    def __init__(self, *, max_sequences: int, max_queued: int, wait_s: float, retry_after_s: int) -> None:
        self.max_sequences = max_sequences
        self.max_queued = max_queued
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s
        self._held: dict[str, int] = {}
        """Samples each run has in flight (runs with none are absent)."""
        self._waiters: dict[str, deque[_Waiter]] = {}
        """Each run's waiting requests, in arrival order (runs with none are absent)."""

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> RunQuotas:
        return cls(max_sequences=settings.run_max_in_flight_sequences or settings.max_in_flight_sequences,
                   max_queued=settings.run_max_queued_requests,
                   wait_s=settings.run_queue_timeout_s, retry_after_s=settings.retry_after_s)

    def in_flight(self, run: str) -> int:
        """Samples `run` has in flight now."""
        return self._held.get(run, 0)

    @property
    def queued(self) -> int:
        """Requests of all runs waiting for their run's turn now."""
        return sum(len(line) for line in self._waiters.values())

    async def acquire(self, run: str, sequences: int) -> RunPermit:
        """A turn of `run` for a request of `sequences` samples: at once, after a wait, or Overloaded.

        Cancelling the wait (the client left) leaves the line and holds nothing.
        """
        line = self._waiters.get(run)
        if not line and self._fits(run, sequences):
            self._take(run, sequences)
            return RunPermit(self, run, sequences)
        if line is not None and len(line) >= self.max_queued:
            raise Overloaded(
                f"run {run!r} has {self.in_flight(run)} samples in flight, its quota "
                f"(gateway.run_max_in_flight_sequences={self.max_sequences}), and {len(line)} of its requests "
                f"already wait (gateway.run_max_queued_requests={self.max_queued}); retry after "
                f"{self.retry_after_s} s, or send fewer of this run's requests at once",
                reason="run_queue_full", retry_after_s=self.retry_after_s)
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = _Waiter(sequences, admitted)
        self._waiters.setdefault(run, deque()).append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(admitted), self.wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if not admitted.done():
                self._leave(run, entry)
            elif isinstance(exc, TimeoutError):  # let in just as the wait ended
                return RunPermit(self, run, sequences)
            else:  # let in, but the request is gone
                self._give_back(run, sequences)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Overloaded(
                f"run {run!r} has {self.in_flight(run)} samples in flight, its quota "
                f"(gateway.run_max_in_flight_sequences={self.max_sequences}); this request waited "
                f"{self.wait_s:g} s (gateway.run_queue_timeout_s) for a turn of its run; retry after "
                f"{self.retry_after_s} s, or raise the quota or the wait", reason="run_quota_timeout",
                retry_after_s=self.retry_after_s) from None
        return RunPermit(self, run, sequences)

    def _fits(self, run: str, sequences: int) -> bool:
        held = self.in_flight(run)
        return held == 0 or held + sequences <= self.max_sequences  # alone, any request runs

    def _take(self, run: str, sequences: int) -> None:
        self._held[run] = self.in_flight(run) + sequences

    def _leave(self, run: str, entry: _Waiter) -> None:
        """Take a waiter out of its run's line without letting it in (its wait ended)."""
        line = self._waiters[run]
        line.remove(entry)
        entry.admitted.cancel()
        if not line:
            del self._waiters[run]
        else:
            self._admit_waiting(run)  # it may have held the ones behind it back

    def _give_back(self, run: str, sequences: int) -> None:
        left = self.in_flight(run) - sequences
        if left > 0:
            self._held[run] = left
        else:
            self._held.pop(run, None)
        self._admit_waiting(run)

    def _admit_waiting(self, run: str) -> None:
        """Let the run's waiters in, in order, while the first one fits."""
        line = self._waiters.get(run)
        while line and self._fits(run, line[0].sequences):
            waiter = line.popleft()
            self._take(run, waiter.sequences)
            waiter.admitted.set_result(None)
        if line is not None and not line:
            del self._waiters[run]
