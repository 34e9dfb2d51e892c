"""Identical requests waiting for the model run as one batch.

Clients fan a group of samples out as n identical requests. Those that wait for the model
with the same key (prompt, adapter, sampling settings) are coalesced: whichever gets the
model first runs them all as one batch of up to MAX_BATCH_ROWS rows and hands each its
share of the sequences (or the error). A coalesced batch is cancelled only when every request
in it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from tandem_inference.engines.transformers.decode import Cancel
from tandem_inference.engines.transformers.sampling import MAX_BATCH_ROWS, Sequence
from tandem_inference.errors import EngineError

RunBatch = Callable[[int, Cancel], list[Sequence]]
"""Runs one batch of `rows` samples, ending early when the cancel is set; model lock held."""


@dataclass
class _Ticket:
    """One request waiting to be coalesced with identical ones; filled by whoever runs it."""

    n: int
    cancel: Cancel | None
    done: bool = False
    result: list[Sequence] | None = None
    error: EngineError | None = None


class _AllSet:
    """Cancels a coalesced batch only once every request in it is cancelled."""

    def __init__(self, events: list[Cancel | None]) -> None:
        self.events = events

    def is_set(self) -> bool:
        return all(e is not None and e.is_set() for e in self.events)


class Coalescer:
    """Requests waiting for the model, by key; `model_lock` is the lock every batch runs under."""

    def __init__(self, model_lock: threading.Lock) -> None:
        self._model_lock = model_lock
        self._guard = threading.Lock()  # guards _pending
        self._pending: dict[Hashable, list[_Ticket]] = {}

    def waiting(self) -> int:
        """How many requests wait to be run now."""
        with self._guard:
            return sum(len(tickets) for tickets in self._pending.values())

    def run(self, key: Hashable, n: int, cancel: Cancel | None, run_batch: RunBatch) -> list[Sequence]:
        """Wait for the model; run this request and its waiting twins, unless a twin ran it already."""
        ticket = _Ticket(n, cancel)
        with self._guard:
            self._pending.setdefault(key, []).append(ticket)
        with self._model_lock:
            if not ticket.done:  # no other thread ran it while this one waited: run it and its twins
                batch = self._take(key, ticket)
                try:
                    seqs = run_batch(sum(t.n for t in batch), _AllSet([t.cancel for t in batch]))
                except EngineError as exc:
                    for t in batch:
                        t.error, t.done = exc, True
                else:
                    for t in batch:
                        t.result, seqs, t.done = seqs[: t.n], seqs[t.n :], True
        if ticket.error is not None:
            raise ticket.error
        assert ticket.result is not None
        return ticket.result

    def _take(self, key: Hashable, first: _Ticket) -> list[_Ticket]:
        """`first` and as many of its waiting twins as fit in one batch; the rest keep waiting."""
        batch, rest, rows = [first], [], first.n
        with self._guard:
            for t in self._pending.pop(key):
                if t is first:
                    continue
                if rows + t.n <= MAX_BATCH_ROWS:
                    batch.append(t)
                    rows += t.n
                else:
                    rest.append(t)
            if rest:
                self._pending[key] = rest
        return batch
