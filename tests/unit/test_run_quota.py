"""The gateway's per-run quota of rollouts in flight (gateway/run_quota.py), on an event loop alone:
the order a run's waiting requests are let in, what a full line, a left client and a large
request do, and that runs do not wait for one another."""

from __future__ import annotations

import asyncio

import pytest

from tandem_inference.errors import Overloaded
from tandem_inference.gateway.run_quota import RunQuotas


def quotas(**kw: object) -> RunQuotas:
    return RunQuotas(**{"max_sequences": 2, "max_queued": 4, "wait_s": 60.0, "retry_after_s": 3, **kw})  # type: ignore[arg-type]


def test_a_runs_requests_beyond_its_quota_wait_in_order_and_other_runs_do_not() -> None:
    async def main() -> None:
        q = quotas()
        held = [await q.acquire("a", 1), await q.acquire("a", 1)]
        order: list[int] = []

        async def waiter(i: int) -> None:
            permit = await q.acquire("a", 1)
            order.append(i)
            held.append(permit)

        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        await asyncio.sleep(0)
        assert q.queued == 3 and q.in_flight("a") == 2
        other = await asyncio.wait_for(q.acquire("b", 2), 1)  # another run: not behind a's line
        assert q.in_flight("b") == 2
        other.release()
        held.pop(0).release()
        held.pop(0).release()
        await asyncio.wait_for(asyncio.gather(tasks[0], tasks[1]), 1)  # the first two in line, in order
        assert order == [0, 1] and not tasks[2].done()
        held.pop(0).release()
        await asyncio.wait_for(tasks[2], 1)
        assert order == [0, 1, 2] and q.in_flight("a") == 2 and q.queued == 0
        for permit in held:
            permit.release()
            permit.release()  # twice is harmless
        assert q.in_flight("a") == 0

    asyncio.run(main())


def test_a_full_line_is_refused_with_the_setting_named_and_a_left_client_holds_nothing() -> None:
    async def main() -> None:
        q = quotas(max_queued=1)
        first = await q.acquire("a", 2)
        waiting = asyncio.create_task(q.acquire("a", 1))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await q.acquire("a", 1)
        assert refused.value.reason == "run_queue_full" and refused.value.retry_after_s == 3
        assert "gateway.run_max_queued_requests=1" in str(refused.value) and "'a'" in str(refused.value)
        waiting.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert q.queued == 0
        first.release()
        assert q.in_flight("a") == 0

    asyncio.run(main())


def test_a_request_larger_than_the_quota_runs_once_its_run_has_nothing_in_flight() -> None:
    async def main() -> None:
        q = quotas()
        small = await q.acquire("a", 1)
        large = asyncio.create_task(q.acquire("a", 8))
        await asyncio.sleep(0)
        assert not large.done()
        small.release()
        permit = await asyncio.wait_for(large, 1)
        assert q.in_flight("a") == 8
        permit.release()

    asyncio.run(main())


def test_a_wait_past_the_limit_is_refused_naming_the_quota_and_the_wait() -> None:
    async def main() -> None:
        q = quotas(max_sequences=1, wait_s=0.01)
        held = await q.acquire("a", 1)
        with pytest.raises(Overloaded) as refused:
            await q.acquire("a", 1)
        assert refused.value.reason == "run_quota_timeout"
        assert "gateway.run_max_in_flight_sequences=1" in str(refused.value)
        assert "gateway.run_queue_timeout_s" in str(refused.value)
        assert q.queued == 0
        held.release()
        assert q.in_flight("a") == 0

    asyncio.run(main())
