"""The gateway's admission control: a budget of sequences and tokens in flight, a bounded queue."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_inference.errors import Overloaded
from tandem_inference.gateway.capacity import Capacity, Permit

pytestmark = pytest.mark.unit


def capacity(*, sequences: int = 8, tokens: int = 100, queued: int = 4, timeout_s: float = 30.0) -> Capacity:
    return Capacity(max_sequences=sequences, max_tokens=tokens, max_queued=queued, queue_timeout_s=timeout_s,
                    retry_after_s=2)


async def waiting(cap: Capacity, sequences: int, tokens: int) -> asyncio.Task[Permit]:
    """Start an acquire that has to wait; returns its task once it is queued."""
    before = cap.queued
    task = asyncio.ensure_future(cap.acquire(sequences, tokens))
    while cap.queued == before and not task.done():
        await asyncio.sleep(0)
    assert not task.done(), "expected the request to wait"
    return task


async def test_within_the_budget_requests_pass_and_beyond_it_they_wait_for_room() -> None:
    cap = capacity()
    a = await cap.acquire(4, 60)
    b = await cap.acquire(4, 40)
    assert (cap.sequences, cap.tokens, cap.requests) == (8, 100, 2)
    c = await waiting(cap, 1, 1)
    a.release()
    permit = await asyncio.wait_for(c, 5)
    assert permit.waited_s >= 0 and (cap.sequences, cap.tokens, cap.queued) == (5, 41, 0)
    a.release()  # twice is harmless
    b.release()
    permit.release()
    assert (cap.sequences, cap.tokens, cap.requests) == (0, 0, 0)


async def test_a_small_request_is_not_held_behind_a_large_one_that_does_not_fit() -> None:
    cap = capacity()
    held = await cap.acquire(4, 90)
    large = await waiting(cap, 4, 50)
    small = await cap.acquire(1, 5)  # fits beside what is in flight: admitted at once
    assert cap.queued == 1 and not large.done()
    held.release()
    await asyncio.wait_for(large, 5)
    small.release()
    large.result().release()


async def test_released_room_goes_to_the_smallest_waiter_first() -> None:
    cap = capacity(tokens=100)
    held = await cap.acquire(1, 100)
    large, small = await waiting(cap, 1, 60), await waiting(cap, 1, 50)
    held.release()
    await asyncio.wait_for(small, 5)
    assert cap.queued == 1 and not large.done()  # 50 + 60 > 100
    small.result().release()
    (await asyncio.wait_for(large, 5)).release()


async def test_a_request_that_waited_half_its_time_goes_before_smaller_ones() -> None:
    cap = capacity(tokens=100, timeout_s=2.0)
    held = [await cap.acquire(1, 50), await cap.acquire(1, 50)]
    large = await waiting(cap, 1, 100)
    await asyncio.sleep(1.1)  # over half of queue_timeout_s
    small = await waiting(cap, 1, 10)  # would fit the room the next release frees, but waits its turn
    held[0].release()
    await asyncio.sleep(0)
    assert not small.done() and not large.done() and cap.queued == 2
    held[1].release()
    (await asyncio.wait_for(large, 5)).release()
    (await asyncio.wait_for(small, 5)).release()


async def test_released_room_goes_to_equal_waiters_in_arrival_order() -> None:
    cap = capacity(sequences=2)
    held = [await cap.acquire(1, 1), await cap.acquire(1, 1)]
    first, second = await waiting(cap, 1, 1), await waiting(cap, 1, 1)
    held[0].release()
    await asyncio.wait_for(first, 5)
    assert cap.queued == 1 and not second.done()
    held[1].release()
    await asyncio.wait_for(second, 5)


async def test_a_full_queue_refuses_at_once_naming_the_setting() -> None:
    cap = capacity(queued=1)
    held = await cap.acquire(8, 1)
    queued = await waiting(cap, 1, 1)
    with pytest.raises(Overloaded, match=r"gateway\.max_queued_requests=1") as info:
        await cap.acquire(1, 1)
    assert info.value.reason == "queue_full" and info.value.retry_after_s == 2
    held.release()
    (await queued).release()


async def test_a_request_that_waits_too_long_is_refused_and_leaves_the_queue() -> None:
    cap = capacity(timeout_s=0.05)
    held = await cap.acquire(8, 1)
    with pytest.raises(Overloaded, match=r"gateway\.queue_timeout_s") as info:
        await cap.acquire(1, 1)
    assert info.value.reason == "queue_timeout" and cap.queued == 0
    held.release()
    assert cap.requests == 0


async def test_a_cancelled_wait_holds_nothing() -> None:
    cap = capacity()
    held = await cap.acquire(8, 1)
    task = await waiting(cap, 1, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    held.release()
    assert (cap.queued, cap.requests, cap.sequences) == (0, 0, 0)


async def test_a_request_larger_than_the_budget_runs_alone() -> None:
    cap = capacity()
    small = await cap.acquire(1, 1)
    huge = await waiting(cap, 64, 10_000)
    small.release()
    permit = await asyncio.wait_for(huge, 5)
    assert cap.sequences == 64
    later = await waiting(cap, 1, 1)
    permit.release()
    (await asyncio.wait_for(later, 5)).release()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 150), st.booleans()), min_size=1, max_size=30))
def test_the_budget_holds_whatever_arrives_and_leaves(requests: list[tuple[int, int, bool]]) -> None:
    async def scenario() -> None:
        cap = capacity(queued=100)
        permits: list[Permit] = []
        tasks = []
        for sequences, tokens, release_one in requests:
            tasks.append(asyncio.ensure_future(cap.acquire(sequences, tokens)))
            await asyncio.sleep(0)
            permits += [t.result() for t in tasks if t.done() and t.result() not in permits]
            if cap.requests > 1:  # several in flight: all within the budget
                assert cap.sequences <= cap.max_sequences and cap.tokens <= cap.max_tokens
            if release_one and permits:
                permits.pop(0).release()
        while tasks:
            await asyncio.sleep(0)
            for t in [t for t in tasks if t.done()]:
                tasks.remove(t)
                t.result().release()
        assert (cap.sequences, cap.tokens, cap.requests, cap.queued) == (0, 0, 0, 0)

    asyncio.run(scenario())


async def test_a_full_queue_keeps_its_smallest_requests() -> None:
    cap = capacity(queued=2)
    held = await cap.acquire(8, 1)
    large, medium = await waiting(cap, 1, 50), await waiting(cap, 1, 20)
    small = asyncio.ensure_future(cap.acquire(1, 5))  # takes the largest waiter's place
    with pytest.raises(Overloaded, match="smaller requests took this one's place") as info:
        await large
    assert info.value.reason == "queue_full" and cap.queued == 2
    with pytest.raises(Overloaded, match="2 requests already wait"):
        await cap.acquire(1, 20)  # no waiter is larger: refused itself
    held.release()
    (await asyncio.wait_for(small, 5)).release()
    (await asyncio.wait_for(medium, 5)).release()
    assert (cap.requests, cap.queued) == (0, 0)
