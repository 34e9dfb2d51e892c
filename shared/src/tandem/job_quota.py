"""Each run's quota of jobs waiting on the train queue: beyond it, a job waits to be enqueued.

The fair turns (tandem.fair_queue) already keep one run's backlog from delaying another run's
turn, so a quota on queued jobs is not needed for fairness. What it bounds is what one run parks
in Redis (a GRPO step holds its trajectories, a `forward_backward` its datums, until it runs) and
how far one client may run ahead of the trainer. Refusing the job past the bound would kill the
client's loop for going fast, which is what users of rate-limited services complain of most; so
the job waits instead, at its enqueuer, until the run has fewer than its quota on the queue:

- the SDK's `train()` waits (polling the queue) up to `ClientSettings.queue_wait_s`, then raises
  `RunQueueFull` naming the run, the quota and the setting (only a trainer that takes no job for
  that long gets there);
- the Tinker service parks a training call beyond the quota with the model's requests that wait
  their turn (tinker/order.py): its future stays pending and it is enqueued, in seq_id order, when
  a poll of the model's futures finds room. Nothing is refused.

The count is of the run's jobs on the queue (those the trainer took are not counted), read from
the jobs' rq `meta` (`fair_queue.job_meta`), up to `fair_queue.WINDOW` jobs from the head. It is
checked, not reserved: two enqueuers of one run at the same instant may each add a job at the
quota's edge. The SDK enqueues one run's jobs from one loop and the Tinker service one model's
under its lock, so neither does in practice.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from tandem.connection import text, translated
from tandem.errors import RunQueueFull
from tandem.fair_queue import WINDOW
from tandem.jobs import GuardedJob, train_queue
from tandem.runs import stored_run

#: Pause between looks at the queue while a job waits for room, in seconds.
POLL_S = 0.25


def queued_jobs(conn: redis.Redis, run: str) -> int:
    """How many jobs of `run` wait on the train queue now."""
    queue = train_queue(conn)
    with translated(conn, f"count the queued jobs of run {run!r}"):
        ids = [text(i) for i in conn.lrange(queue.key, 0, WINDOW - 1)]
        if not ids:
            return 0
        with conn.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(GuardedJob.key_for(job_id), "meta")
            metas = pipe.execute()
    return sum(1 for raw in metas if stored_run(raw) == run)


def has_room(conn: redis.Redis, run: str, limit: int) -> bool:
    """Whether one more job of `run` fits its quota of `limit` queued jobs."""
    return queued_jobs(conn, run) < limit


def wait_for_room(conn: redis.Redis, run: str, limit: int, wait_s: float, *,
                  sleep: Callable[[float], None] = time.sleep) -> float:
    """Return (the seconds waited) once `run` has fewer than `limit` jobs on the queue; RunQueueFull
    when it still has them after `wait_s` seconds."""
    started = time.monotonic()
    while True:
        held = queued_jobs(conn, run)
        if held < limit:
            return time.monotonic() - started
        if time.monotonic() - started >= wait_s:
            raise RunQueueFull(
                f"run {run!r} has {held} jobs waiting on the train queue, its quota (run_max_queued_jobs="
                f"{limit}), and none was taken in {wait_s:g} s (queue_wait_s): is a trainer running? "
                "Wait for the run's jobs, or raise TANDEM_RUN_MAX_QUEUED_JOBS or TANDEM_QUEUE_WAIT_S")
        sleep(POLL_S)

