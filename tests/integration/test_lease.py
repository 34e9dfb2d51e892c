from __future__ import annotations

import threading
import time

import pytest

from tandem.errors import LeaseTimeout, ValidationFailed
from tandem.lease import INFERENCE, GpuLease, LeaseState

pytestmark = pytest.mark.integration


def test_trainer_waits_for_inference_to_grant(redis_conn) -> None:
    trainer = GpuLease(redis_conn, ttl_s=5, holder="t1")
    inference = GpuLease(redis_conn, ttl_s=5)

    def serve() -> None:
        while inference.state() is not LeaseState.REQUESTED:
            time.sleep(0.01)
        inference.grant()

    t = threading.Thread(target=serve)
    t.start()
    trainer.acquire(wait_s=5)
    t.join()
    assert inference.state() is LeaseState.GRANTED
    trainer.release()
    assert inference.state() is None


def test_a_second_trainer_cannot_take_a_held_lease(redis_conn) -> None:
    a = GpuLease(redis_conn, ttl_s=5, holder="a")
    b = GpuLease(redis_conn, ttl_s=5, holder="b")
    assert a.request()
    assert not b.request()
    b.release()  # not ours: nothing happens
    assert a.state() is LeaseState.REQUESTED


def test_a_lease_held_by_a_dead_trainer_expires(redis_conn) -> None:
    dead = GpuLease(redis_conn, ttl_s=0.2, holder="dead")
    assert dead.request()
    time.sleep(0.35)
    alive = GpuLease(redis_conn, ttl_s=5, holder="alive")
    assert alive.request()
    assert not dead.renew()


def test_acquire_times_out_and_gives_the_request_back(redis_conn) -> None:
    lease = GpuLease(redis_conn, ttl_s=5, holder="t")
    with pytest.raises(LeaseTimeout, match="did not release the GPU"):
        lease.acquire(wait_s=0.2)
    assert lease.state() is None


def test_a_lease_state_that_is_not_one_is_validation_failed_naming_the_key(redis_conn) -> None:
    redis_conn.hset("tandem:gpu:lease", "state", "bogus")
    with pytest.raises(ValidationFailed, match="tandem:gpu:lease"):
        GpuLease(redis_conn).state()


def test_each_side_is_woken_by_the_bell_the_other_rings(redis_conn) -> None:
    trainer = GpuLease(redis_conn, ttl_s=30, holder="t1")
    inference = GpuLease(redis_conn, ttl_s=30)
    assert not inference.wait_bell(INFERENCE, 0.05)  # nothing rang yet
    rang: list[bool] = []
    waiter = threading.Thread(target=lambda: rang.append(inference.wait_bell(INFERENCE, 60)))
    waiter.start()
    assert trainer.request()  # rings inference's bell: it wakes long before its 60 s
    waiter.join(10)
    assert rang == [True] and inference.state() is LeaseState.REQUESTED

    granted: list[float] = []
    acquiring = threading.Thread(target=lambda: granted.append(trainer.acquire(wait_s=60, poll_s=60)))
    acquiring.start()
    inference.grant()  # rings the trainer's bell: acquire returns without waiting out its poll
    acquiring.join(10)
    assert len(granted) == 1

    trainer.release()  # rings inference's bell again: the GPU is back
    assert inference.wait_bell(INFERENCE, 60) and inference.state() is None
    assert not inference.wait_bell(INFERENCE, 0.05)  # a ring wakes one wait
