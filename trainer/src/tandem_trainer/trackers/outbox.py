"""The experiment tracker off the training path: a bounded queue that one thread empties.

A tracker is a network service (or a client library in front of one), and a training step must not
wait for it: called from the job, a tracking server that hangs or is down held each job for as long
as its client waited (MLflow's: 120 s a request, seven retries), under the run's lock. The job
therefore only puts the step in `TrackerOutbox`, which never blocks; a daemon thread of the trainer
process takes the steps out in order and hands them to the tracker.

What an outage costs is the curve's points, nothing else:
- a step the tracker fails on is skipped, counted in `tandem_trainer_tracker_errors_total`, and
  logged as `tracker.failed` at WARNING: the first failure of an outage at once, repeats at most
  once per `REPEAT_LOG_S` (each at DEBUG, with its traceback), and `tracker.recovered` when a step
  gets through again: the steps after an outage reach the tracker;
- a step that finds the queue full (the tracker is slow or hangs) is dropped and counted in
  `tandem_trainer_tracker_dropped_total` (`tracker.dropped`, logged like a failure);
- at shutdown the thread gets `DRAIN_S` to empty the queue; what is left is dropped and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from tandem.events import EventStream
from tandem.jobs import TrainResult
from tandem.runs import RunSpec
from tandem_trainer.metrics import TrainerMetrics
from tandem_trainer.tracking import Tracker

log = logging.getLogger(__name__)

#: Steps waiting for the tracker at most; one more is dropped. A step is a few KiB of numbers.
QUEUE_STEPS = 256
#: Seconds a stopping trainer waits for the queue to empty (a compose stop grants the trainer 60 s).
DRAIN_S = 15.0
#: Seconds between two WARNING lines about the same kind of trouble (failures, drops).
REPEAT_LOG_S = 60.0


@dataclass
class _Step:
    spec: RunSpec
    result: TrainResult
    stepped_at: float
    events: EventStream
    queued_at: float


@dataclass
class Repeats:
    """When a repeated warning is due: at once after a quiet `every_s`, else held back and counted."""

    every_s: float
    last: float | None = None
    held: int = 0

    def due(self, now: float) -> int | None:
        """None: held back; else say it now, with the number held back since the last line."""
        if self.last is not None and now - self.last < self.every_s:
            self.held += 1
            return None
        self.last, held, self.held = now, self.held, 0
        return held

    def reset(self) -> None:
        """The trouble is over: its next occurrence is said at once."""
        self.last, self.held = None, 0


class TrackerOutbox:
    """A `Tracker` that queues each step for `tracker` and returns at once; see the module's docstring."""

    def __init__(self, tracker: Tracker, kind: str, metrics: TrainerMetrics, *, capacity: int = QUEUE_STEPS,
                 drain_s: float = DRAIN_S, repeat_log_s: float = REPEAT_LOG_S) -> None:
        self.tracker, self.kind, self.metrics = tracker, kind, metrics
        self.capacity, self.drain_s = capacity, drain_s
        self._pending: deque[_Step] = deque()
        self._ready = threading.Condition()
        self._closing = False
        self._drops = Repeats(repeat_log_s)  # the job's side (log_step)
        self._failures = Repeats(repeat_log_s)  # the thread's, as is:
        self._failed = 0  # steps failed since the tracker last took one
        self._thread = threading.Thread(target=self._send_all, name=f"tracker-{kind}", daemon=True)
        self._thread.start()

    def log_step(self, spec: RunSpec, result: TrainResult, stepped_at: float, events: EventStream) -> None:
        """Queue the step for the tracker; drop it (counted) when the queue is full or closed."""
        with self._ready:
            if not self._closing and len(self._pending) < self.capacity:
                self._pending.append(_Step(spec, result, stepped_at, events, time.monotonic()))
                self._ready.notify()
                return
            closing, queued = self._closing, len(self._pending)
        self.metrics.tracker_dropped.inc()
        held = self._drops.due(time.monotonic())
        if held is not None:
            why = "the trainer is stopping" if closing else f"{queued} steps wait for a tracker that is behind"
            log.warning("tracker.dropped run=%s version=%d kind=%s: %s; the curve skips this step, training goes "
                        "on%s", spec.name, result.version, self.kind, why, since(held, "dropped"))

    def close(self) -> None:
        """Let the thread send what is queued, for `drain_s` at most; then the tracker closes."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(self.drain_s)
        if self._thread.is_alive():
            with self._ready:
                left = len(self._pending)
                self._pending.clear()
            self.metrics.tracker_dropped.inc(left)
            log.warning("tracker.drain_timeout kind=%s dropped=%d: the tracker did not take the queued steps and "
                        "close within %.0f s; the curve misses the steps dropped", self.kind, left, self.drain_s)

    # the thread -------------------------------------------------------------------
    def _send_all(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closing:
                    self._ready.wait()
                if not self._pending:
                    break
                step = self._pending.popleft()
            self._send(step)
        try:
            self.tracker.close()
        except Exception as exc:  # noqa: BLE001 - the trainer is stopping; its tracker must not stop it
            log.warning("tracker.close_failed kind=%s error=%s message=%s", self.kind, type(exc).__name__,
                        one_line(exc))

    def _send(self, step: _Step) -> None:
        run, version = step.spec.name, step.result.version
        t0 = time.monotonic()
        try:
            self.tracker.log_step(step.spec, step.result, step.stepped_at, step.events)
        except Exception as exc:  # noqa: BLE001 - whatever the tracker does costs only this point
            self.metrics.tracker_errors.inc()
            self._failed += 1
            log.debug("tracker.failed run=%s version=%d kind=%s", run, version, self.kind, exc_info=True)
            held = self._failures.due(time.monotonic())
            if held is not None:
                log.warning("tracker.failed run=%s version=%d kind=%s error=%s message=%s: the curve skips this "
                            "step, training goes on%s", run, version, self.kind, type(exc).__name__, one_line(exc),
                            since(held, "failed"))
            return
        if self._failed:
            log.info("tracker.recovered kind=%s failed=%d: the curve goes on from run=%s version=%d", self.kind,
                     self._failed, run, version)
            self._failed = 0
            self._failures.reset()
        log.info("tracker.logged run=%s version=%d step=%d duration_s=%.3f queued_s=%.3f", run, version,
                 step.result.step, time.monotonic() - t0, t0 - step.queued_at)


def since(held: int, what: str) -> str:
    """The tail of a repeated warning: how many were held back since the last line."""
    return f" ({held} more {what} since the last line)" if held else ""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (MLflow's span several)."""
    return " ".join(str(exc).split())
