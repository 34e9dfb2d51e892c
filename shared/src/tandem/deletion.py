"""Deleting a run: what Redis holds of it goes in one transaction; the trainer removes its files.

    DELETE /v1/runs/<run>        the gateway (`Client.delete_run`, `tandem delete RUN`)

`delete_run` removes, in one MULTI/EXEC transaction that WATCHes everything a trainer or a
client could change under it (the run's spec and lock, the train queue, the jobs taken off it):

- the run's keys (`keys.run_state`: spec, versions, job records, step counter, serving and
  loaded versions) and its name in `tandem:runs`;
- not its load attempts (`keys.run_load_attempts`): they stay, each version's count made its
  floor, so that a run created again under the name continues the count. Its adapters get names
  no engine was given for the deleted run, whose adapters may still be loaded (a request holds
  them) or be found in an engine whose controller was down; those below the floor are never
  taken for the new run's;
- its entry in the train queue's fair turns (`rq:fair:<queue>`, tandem.fair_queue): a run of the
  same name created later starts at the queue's clock, as any new run does;
- its jobs still on the train queue, each with a `train_failed` event, so that a client waiting
  on one is told why instead of waiting out its timeout;
- and it appends `run_deleted`, on which every inference replica stops routing to the run and
  unloads its adapters (the replica that answered the DELETE does so before it answers), and
  adds the name to `tandem:runs:deleted`, on which a trainer, the one writer of the adapter
  store, removes the run's directory and then takes the name out (tandem_trainer.store_cleanup).

The run's episodes (the ids `keys.run_episodes` lists whose episode names the run; an episode
the gateway saved before that set existed expires as it would) are deleted after the transaction.

Refused with `RunBusy`, naming the job, while a job of the run runs: one rq has started or
taken off the queue to start, or the run's lock held by a live trainer (a lock whose holder is
dead is removed with the run). A train job enqueued after the deletion is refused by the
trainer, which finds no run; the trainer looks again once it holds the run's lock, so a job
that waited for the lock cannot bring the run back.

Kept: the event stream's entries of the run (a log, trimmed with the stream), and rq's records
of its finished and failed jobs (they expire as rq was told, 7 days). A run that is not
registered is `RunNotFound`: deleting a deleted run is a 404 at the gateway, never a no-op.

It runs as the inference's Redis user; tandem.acl gives that role what deleting needs, and no
more: it may take jobs off the queue, never put one on it.
"""

from __future__ import annotations

import logging
import time
from typing import cast

import redis
from pydantic import BaseModel, Field
from redis.client import Pipeline
from rq.serializers import JSONSerializer

from tandem import keys
from tandem.connection import text, translated
from tandem.errors import RunBusy, RunNotFound
from tandem.events import Event, EventKind, EventStream
from tandem.fair_queue import fair_key
from tandem.jobs import GuardedJob, train_queue
from tandem.runs import RUN_NAME, stored_run

__all__ = ["Deletion", "delete_episodes", "delete_run"]

log = logging.getLogger(__name__)

#: Tries of the transaction while the train queue or the run changes under it.
DELETE_ATTEMPTS = 10


class Deletion(BaseModel):
    """What deleting a run removed (the answer of DELETE /v1/runs/<run>)."""

    run: str
    versions: list[int] = Field(default_factory=list)
    """Registered versions whose registry entries went; their directories go by the trainer's hand."""
    jobs: list[str] = Field(default_factory=list)
    """Jobs of the run that were still on the train queue, removed (each got a `train_failed`)."""
    episodes: int = 0
    """Episodes of the run deleted."""


def delete_run(conn: redis.Redis, run: str) -> Deletion:
    """Delete `run` (see the module docstring); RunNotFound when it is not registered, RunBusy
    naming the job while one of it runs. Redis errors leave as BackendUnavailable."""
    if not RUN_NAME.fullmatch(run):
        raise RunNotFound(f"unknown run {run!r}: no run has such a name")
    started = time.perf_counter()
    for _ in range(DELETE_ATTEMPTS):
        with translated(conn, f"delete run {run!r}"), conn.pipeline() as pipe:
            try:
                deletion = _delete(conn, pipe, run)
            except redis.WatchError:
                continue  # a job enqueued or taken, a lock taken meanwhile: look again
        deletion.episodes = delete_episodes(conn, run)
        log.info("run.deleted run=%s versions=%s jobs=%s episodes=%d duration_ms=%.1f", run, deletion.versions,
                 deletion.jobs, deletion.episodes, (time.perf_counter() - started) * 1000)
        return deletion
    raise RunBusy(f"run {run!r}: the train queue kept changing while the run was deleted ({DELETE_ATTEMPTS} "
                  "tries); nothing was deleted, try again")


def _delete(conn: redis.Redis, pipe: Pipeline, run: str) -> Deletion:
    """One try of the transaction; raises WatchError when something it read changed before EXEC."""
    queue = train_queue(conn)
    lock = keys.run_lock(run)
    # two WATCHes: a command's keys must all fall under one rule of the Redis user (tandem.acl)
    attempts = keys.run_load_attempts(run)
    pipe.watch(keys.run(run), lock, attempts)  # type: ignore[no-untyped-call]
    pipe.watch(queue.key, queue.intermediate_queue_key, queue.started_job_registry.key)  # type: ignore[no-untyped-call]
    if pipe.get(keys.run(run)) is None:
        known = sorted(text(m) for m in pipe.smembers(keys.RUNS))
        raise RunNotFound(f"unknown run {run!r}; known runs: {known}")
    taken = [text(i) for i in pipe.lrange(queue.intermediate_queue_key, 0, -1)]
    running = [j for j in _jobs(conn, [*queue.started_job_registry.get_job_ids(cleanup=False), *taken])
               if j.named_run() == run]
    holder = pipe.get(lock)
    if running or (holder is not None and _holder_alive(pipe, text(holder))):
        busy = running[0].id if running else None
        what = f"job {busy} of it runs" if busy else f"its lock is held by trainer {text(holder or b'')!r}"
        raise RunBusy(f"run {run!r} cannot be deleted while {what}; wait for it to end (a moment "
                      "after its version serves), then delete the run again", job_id=busy)
    queued = [j for j in _jobs(conn, [text(i) for i in pipe.lrange(queue.key, 0, -1)]) if j.named_run() == run]
    scored = cast(list[tuple[bytes, float]], pipe.zrange(keys.run_versions(run), 0, -1, withscores=True))
    versions = sorted(int(score) for _, score in scored)
    counts = cast(dict[bytes, bytes], pipe.hgetall(attempts))
    floors = {f"floor:{text(v)}": int(n) for v, n in counts.items() if text(v).isdigit()}
    pipe.multi()
    pipe.delete(*keys.run_state(run))
    for field, count in floors.items():
        pipe.hset(attempts, field, count)
    if holder is not None:
        pipe.delete(lock)  # its holder is dead
    pipe.srem(keys.RUNS, run)
    pipe.sadd(keys.DELETED_RUNS, run)
    pipe.hdel(fair_key(queue.key), run)
    for job in queued:
        pipe.lrem(queue.key, 0, job.id)
        pipe.delete(job.key)
        EventStream.append_in(pipe, Event(
            kind=EventKind.TRAIN_FAILED, run=run, job_id=job.id,
            data={"message": f"run {run!r} was deleted before the job ran", "field": "run", "retries_left": 0}))
    jobs = [job.id for job in queued]
    EventStream.append_in(pipe, Event(kind=EventKind.RUN_DELETED, run=run, data={"versions": versions, "jobs": jobs}))
    pipe.execute()
    return Deletion(run=run, versions=versions, jobs=jobs)


def _jobs(conn: redis.Redis, ids: list[str]) -> list[GuardedJob]:
    """The rq jobs of these ids that still exist (read as the trainer reads them: nothing is resolved)."""
    if not ids:
        return []
    found = GuardedJob.fetch_many(ids, connection=conn, serializer=JSONSerializer)
    return [job for job in found if isinstance(job, GuardedJob)]


def _holder_alive(pipe: Pipeline, holder: str) -> bool:
    """Whether the trainer named by a run lock's value (`<worker>#<token>|<nonce>`, tandem_trainer.run_lock)
    still lives: its liveness key holds its token."""
    owner = holder.split("|", 1)[0]
    alive = pipe.get(keys.trainer_alive(owner.split("#", 1)[0]))
    return alive is not None and text(alive) == owner


def delete_episodes(conn: redis.Redis, run: str) -> int:
    """Delete the episodes of `run` (those its set `keys.run_episodes` names) and the set; returns
    how many. Each is deleted only if it still names the run when it goes (an id may be used again by
    another run once an episode expired), so no other run's episode is ever touched."""
    index = keys.run_episodes(run)
    removed = 0
    with translated(conn, f"delete the episodes of run {run!r}"):
        for episode_id in sorted(text(m) for m in conn.smembers(index)):
            removed += _delete_episode(conn, keys.episode(episode_id), run)
        conn.delete(index)
    return removed


def _delete_episode(conn: redis.Redis, key: str, run: str) -> int:
    with conn.pipeline() as pipe:
        try:
            pipe.watch(key)  # type: ignore[no-untyped-call]
            if stored_run(pipe.get(key)) != run:
                return 0
            pipe.multi()
            pipe.delete(key)
            pipe.execute()
            return 1
        except redis.WatchError:
            log.warning("episode %s changed while run %s was deleted; left for its expiry", key, run)
            return 0

