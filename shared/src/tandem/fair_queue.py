"""Fair turns across runs on the one train queue: a run's burst of jobs cannot starve another run.

Every run's jobs go on the same rq queue, in the order they were sent. Taken in that order (rq's
own way), one run that queues forty steps makes every other run wait for all forty. The trainer
takes them instead by **start-time fair queuing, weighted by tokens**:

- each job carries its run and its cost, the tokens it trains, in its rq `meta` (`job_meta`);
- each run has a virtual finish time (`rq:fair:<queue>`, a hash run -> tokens served), and the
  queue a virtual clock: the start of the job taken last;
- the next job is the first job in the queue of the run whose virtual time, lifted to the clock,
  is the lowest (ties: the run whose first job is nearer the head); taking it moves that run's
  time to `max(its time, clock) + cost`, and the clock to `max(its time, clock)`.

So runs that keep jobs waiting share the trainer's tokens equally, whatever the size of each one's
backlog; a run idle for a while starts again at the clock, not with credit for the time it was
idle (no burst after a pause). Within a run nothing changes: its jobs run in the order they were
sent (Tinker's `forward_backward` before the `optim_step` that applies it, a retried job first,
as rq puts it back at the head). Nothing is refused for its share: a job beyond it waits.

The choice is one Lua script (`_PICK`) over the queue's job ids and their `meta`, atomic with the
move to rq's intermediate queue, so two workers never take the same job and a crash loses none
(rq's recovery of the intermediate queue is unchanged). It reads the whole queue, up to `WINDOW`
jobs from the head: the cost is one hash read per queued job each time a job is taken. A job
whose meta is missing or unreadable counts as run '' with cost 1, so it is neither lost nor
favoured. The meta is the enqueuer's word: whoever may enqueue may claim another run's name for a
job, which changes only whose turn it spends.
"""

from __future__ import annotations

from typing import Any

from redis import Redis
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.intermediate_queue import IntermediateQueue

#: The most queued jobs the scheduler looks at, from the head; jobs behind them wait their turn in order.
WINDOW = 10_000

#: The hash field holding the queue's virtual clock (not a run name: run names have no ':').
CLOCK = ":clock"

# Shared by both scripts: `turn(id)`, the run and cost a job's meta names; `charge(run, cost, start)`.
_COMMON = """
local function turn(id)
  local run, cost = '', 1
  local raw = redis.call('HGET', ARGV[1] .. id, 'meta')
  if raw then
    local ok, meta = pcall(cjson.decode, raw)
    if ok and type(meta) == 'table' then
      if type(meta['run']) == 'string' then run = meta['run'] end
      if type(meta['cost']) == 'number' and meta['cost'] >= 1 then cost = meta['cost'] end
    end
  end
  return run, cost
end
local clock = tonumber(redis.call('HGET', KEYS[1], ARGV[2]) or '0') or 0
local function start_of(run)
  return math.max(tonumber(redis.call('HGET', KEYS[1], run) or '0') or 0, clock)
end
local function charge(run, cost, start)
  redis.call('HSET', KEYS[1], run, tostring(start + cost), ARGV[2], tostring(start))
end
"""

#: KEYS: the fair hash, the queue, the intermediate queue; ARGV: the job key prefix, CLOCK, WINDOW.
_PICK = _COMMON + """
local ids = redis.call('LRANGE', KEYS[2], 0, tonumber(ARGV[3]) - 1)
if #ids == 0 then return false end
local seen, best, best_run, best_cost, best_start = {}, nil, nil, 1, nil
for _, id in ipairs(ids) do
  local run, cost = turn(id)
  if not seen[run] then
    seen[run] = true
    local start = start_of(run)
    if best_start == nil or start < best_start then
      best, best_run, best_cost, best_start = id, run, cost, start
    end
  end
end
redis.call('LREM', KEYS[2], 1, best)
redis.call('RPUSH', KEYS[3], best)
charge(best_run, best_cost, best_start)
return best
"""

#: KEYS: the fair hash; ARGV: the job key prefix, CLOCK, the id of a job taken by rq's blocking move.
_CHARGE = _COMMON + """
local run, cost = turn(ARGV[3])
charge(run, cost, start_of(run))
return 1
"""


def fair_key(queue_key: str) -> str:
    """The hash of the runs' virtual times on the queue whose rq key is `queue_key`."""
    return "rq:fair:" + queue_key.removeprefix(Queue.redis_queue_namespace_prefix)


def job_meta(run: str, cost: int) -> dict[str, Any]:
    """The rq `meta` a job carries for its turn: its run, and its cost in tokens (at least 1)."""
    return {"run": run, "cost": max(1, int(cost))}


class FairQueue(Queue):
    """An rq queue whose worker takes jobs in fair turns across runs (see the module's docstring)."""

    @classmethod
    def lmove(cls, connection: Redis, queue_key: str, timeout: int | None) -> tuple[str, Any] | None:
        """The next job by fair turns, moved to the intermediate queue; blocks up to `timeout` s when
        the queue is empty (then the first job to come is the only one there), as rq's own does."""
        intermediate = IntermediateQueue(queue_key, connection)
        fair, prefix = fair_key(queue_key), cls.job_class.redis_job_namespace_prefix
        picked = connection.eval(_PICK, 3, fair, queue_key, intermediate.key, prefix, CLOCK, WINDOW)
        if picked is not None:
            return queue_key, picked
        if timeout is None:
            return None
        if timeout == 0:
            raise ValueError("RQ does not support indefinite timeouts. Please pick a timeout value > 0")
        result = connection.blmove(queue_key, intermediate.key, timeout)
        if result is None:
            raise DequeueTimeout(timeout, queue_key)
        connection.eval(_CHARGE, 1, fair, prefix, CLOCK, result)  # the only job there: its turn, counted
        return queue_key, result
