"""Fair turns across runs on the train queue (tandem.fair_queue), against a real Redis.

The trainer's user takes jobs (its ACL is what the worker has), the client's user enqueues them:
the order in which a worker would take them is read by moving them off the queue one by one.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from rq.exceptions import DequeueTimeout

from tandem import keys
from tandem.fair_queue import CLOCK, FairQueue, fair_key
from tandem.jobs import train_queue


def _enqueue(conn: Any, job_id: str, run: str | None, cost: int = 1, *, raw_meta: bytes | None = None) -> None:
    """A job on the train queue with the turn's meta (`run` None: a job with no meta at all)."""
    meta = {"run": run, "cost": cost} if run is not None else None
    train_queue(conn).enqueue("tandem_trainer.worker.run_train_job", {"run": run or "x"}, job_id=job_id, meta=meta)
    if raw_meta is not None:
        conn.hset(f"rq:job:{job_id}", "meta", raw_meta)


def _order(conn: Any) -> list[str]:
    """The job ids in the order a worker takes them (each moved to the intermediate queue)."""
    key = train_queue(conn).key
    taken = []
    while (picked := FairQueue.lmove(conn, key, None)) is not None:
        taken.append(picked[1].decode())
    return taken


def test_a_burst_of_one_run_does_not_starve_another(client_conn: Any, trainer_conn: Any) -> None:
    for i in range(6):
        _enqueue(client_conn, f"a{i}", "a")
    _enqueue(client_conn, "b0", "b")
    _enqueue(client_conn, "b1", "b")
    _enqueue(client_conn, "c0", "c")

    order = _order(trainer_conn)

    # a goes first (nearest the head), then b and c have their turns before a's backlog
    assert order[:4] == ["a0", "b0", "c0", "a1"]
    assert order.index("b1") < order.index("a3")
    for run in "abc":  # within a run, the order it sent its jobs in
        mine = [j for j in order if j[0] == run]
        assert mine == sorted(mine, key=lambda j: int(j[1:]))
    assert sorted(order) == sorted([f"a{i}" for i in range(6)] + ["b0", "b1", "c0"])
    assert trainer_conn.llen(f"rq:queue:{keys.TRAIN_QUEUE}:intermediate") == 9  # taken, not lost


def test_turns_are_weighted_by_tokens(client_conn: Any, trainer_conn: Any) -> None:
    for i in range(3):
        _enqueue(client_conn, f"big{i}", "big", cost=1000)
    for i in range(12):
        _enqueue(client_conn, f"small{i:02d}", "small", cost=100)

    order = _order(trainer_conn)

    # each big job buys the small run ten jobs' worth of turns
    assert order.index("big1") > order.index("small09")
    assert order.index("big0") == 0


def test_an_idle_run_starts_at_the_clock_not_with_credit(client_conn: Any, trainer_conn: Any) -> None:
    for i in range(4):
        _enqueue(client_conn, f"a{i}", "a", cost=10)
    assert _order(trainer_conn) == ["a0", "a1", "a2", "a3"]
    clock = float(trainer_conn.hget(fair_key(f"rq:queue:{keys.TRAIN_QUEUE}"), CLOCK))
    assert clock == 30.0

    # b was idle meanwhile: it starts at the clock (30), one job ahead of a (whose next starts at
    # 40), not with credit for the 40 tokens a trained alone; then they alternate
    for i in range(3):
        _enqueue(client_conn, f"a{4 + i}", "a", cost=10)
        _enqueue(client_conn, f"b{i}", "b", cost=10)
    assert _order(trainer_conn) == ["b0", "a4", "b1", "a5", "b2", "a6"]


def test_a_job_with_unreadable_meta_is_taken_in_its_turn(client_conn: Any, trainer_conn: Any) -> None:
    _enqueue(client_conn, "x0", "a", raw_meta=b"\xff not json")
    _enqueue(client_conn, "x1", None)
    _enqueue(client_conn, "a0", "a")
    _enqueue(client_conn, "weird", "a", raw_meta=b'{"run": ["a"], "cost": -5}')

    order = _order(trainer_conn)

    assert order == ["x0", "a0", "x1", "weird"]  # both unreadable ones count as run '' with cost 1


def test_an_empty_queue_blocks_and_counts_the_job_that_comes(client_conn: Any, trainer_conn: Any) -> None:
    key = train_queue(trainer_conn).key
    with pytest.raises(DequeueTimeout):
        FairQueue.lmove(trainer_conn, key, 1)
    assert FairQueue.lmove(trainer_conn, key, None) is None

    waiting = threading.Event()
    later = threading.Thread(target=lambda: (waiting.wait(5), _enqueue(client_conn, "late", "b", cost=7)))
    later.start()
    waiting.set()
    picked = FairQueue.lmove(trainer_conn, key, 10)  # blocks until the job comes
    later.join()
    assert picked is not None and picked[1] == b"late"
    assert float(trainer_conn.hget(fair_key(key), "b")) == 7.0  # its turn counted
