"""The gateway's admission control: a budget of sequences and tokens in flight, a bounded queue."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_inference.errors import Overloaded
from tandem_inference.gateway.capacity import Capacity, Permit

pytestmark = pytest.mark.unit


class Clock:
    """The capacity's clock, moved by the test: when a waiter turns overdue (half of queue_timeout_s)
    is the test's to say, however slowly the machine runs. The queue timeout itself stays real."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def capacity(*, sequences: int = 8, tokens: int = 100, queued: int = 4, timeout_s: float = 30.0,
             clock: Clock | None = None) -> Capacity:
    return Capacity(max_sequences=sequences, max_tokens=tokens, max_queued=queued, queue_timeout_s=timeout_s,
                    retry_after_s=2, **({"clock": clock} if clock else {}))


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


async def settled() -> None:
    """Let the tasks that were just admitted (or refused) run to their end."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_an_overdue_request_is_passed_by_smaller_ones_up_to_its_size_then_holds_them_back() -> None:
    clock = Clock()
    cap = capacity(tokens=100, queued=20, clock=clock)
    held = [await cap.acquire(1, 50), await cap.acquire(1, 50)]
    large = await waiting(cap, 1, 60)
    clock.now += 15  # half of queue_timeout_s: overdue, its allowance is 60 tokens
    smalls = [await waiting(cap, 1, 10) for _ in range(8)]
    held[0].release()  # 50 tokens free: five smaller ones pass it (50 of its 60)
    await settled()
    assert [t.done() for t in smalls] == [True] * 5 + [False] * 3 and not large.done()
    smalls[0].result().release()  # the sixth passes too: 60 of 60
    await settled()
    assert smalls[5].done() and not smalls[6].done()
    smalls[1].result().release()  # 10 free, and the seventh would fit, but the allowance is spent
    await settled()
    assert not smalls[6].done() and not large.done() and cap.tokens == 90
    held[1].release()  # 60 free: the large one gets in, before the seventh
    permit = await asyncio.wait_for(large, 5)
    assert permit.waited_s == 15 and not smalls[6].done() and cap.tokens == 100
    for t in smalls[2:6]:
        t.result().release()
    await settled()
    assert smalls[6].done() and smalls[7].done()  # no one is overdue now: smallest first again
    for t in smalls[6:]:
        t.result().release()
    permit.release()
    assert (cap.tokens, cap.requests, cap.queued) == (0, 0, 0)


async def test_small_requests_pass_a_steady_supply_of_overdue_large_ones_which_still_get_in() -> None:
    """Large requests keep arriving and every one turns overdue; a small one gets in at the next
    release all the same, and a large one at the release after it."""
    clock = Clock()
    cap = capacity(tokens=100, queued=50, clock=clock)
    in_flight = [await cap.acquire(1, 50), await cap.acquire(1, 50)]
    queue = [await waiting(cap, 1, 50) for _ in range(4)]
    admitted_large = []
    for _ in range(12):
        clock.now += 15  # the queue's head (and every large one behind it) is overdue
        queue.append(await waiting(cap, 1, 50))  # the steady supply
        small = await waiting(cap, 1, 5)
        in_flight.pop(0).release()
        await settled()
        assert small.done(), "a small request waited behind overdue large ones"
        assert not queue[0].done()  # 45 tokens free: the head needs 50
        small.result().release()  # a small request ends quickly: the head gets in
        await settled()
        assert queue[0].done() and not queue[1].done()
        admitted_large.append(queue.pop(0))
        in_flight.append(admitted_large[-1].result())
    assert len(admitted_large) == 12 and cap.queued == len(queue)
    for permit in in_flight:
        permit.release()
    for task in queue:
        (await asyncio.wait_for(task, 5)).release()
    assert (cap.tokens, cap.requests, cap.queued) == (0, 0, 0)


async def test_a_newcomer_smaller_than_an_overdue_request_that_fits_is_admitted_at_once() -> None:
    clock = Clock()
    cap = capacity(sequences=8, tokens=100, clock=clock)
    held = await cap.acquire(7, 60)
    large = await waiting(cap, 2, 50)  # nine sequences: does not fit
    clock.now += 15
    small = await asyncio.wait_for(cap.acquire(1, 10), 1)  # smaller: passes it at once
    assert cap.queued == 1 and not large.done()
    small.release()
    no_smaller = await waiting(cap, 1, 50)  # fits beside what is in flight, but is no smaller: waits
    held.release()
    (await asyncio.wait_for(large, 5)).release()
    (await asyncio.wait_for(no_smaller, 5)).release()


async def test_an_overdue_request_that_leaves_lets_the_ones_it_held_back_in() -> None:
    clock = Clock()
    cap = capacity(tokens=100, queued=10, clock=clock)
    held = [await cap.acquire(1, 50), await cap.acquire(1, 50)]
    large = await waiting(cap, 1, 40)
    clock.now += 15
    smalls = [await waiting(cap, 1, 20) for _ in range(3)]
    held[0].release()  # two pass (40 of its 40 tokens); the third does not fit
    await settled()
    assert [t.done() for t in smalls] == [True, True, False] and not large.done()
    smalls[0].result().release()  # the third fits now, but the allowance is spent: held back
    await settled()
    assert not smalls[2].done()
    large.cancel()  # its client left
    await settled()
    assert smalls[2].done() and cap.queued == 0
    for permit in (held[1], smalls[1].result(), smalls[2].result()):
        permit.release()
    assert (cap.tokens, cap.requests) == (0, 0)


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
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 150), st.booleans(), st.booleans()), min_size=1,
                max_size=30))
def test_the_budget_holds_whatever_arrives_and_leaves(requests: list[tuple[int, int, bool, bool]]) -> None:
    async def scenario() -> None:
        clock = Clock()
        cap = capacity(queued=100, clock=clock)
        permits: list[Permit] = []
        tasks = []
        for sequences, tokens, release_one, later in requests:
            if later:  # the waiters so far turn overdue
                clock.now += 15
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
