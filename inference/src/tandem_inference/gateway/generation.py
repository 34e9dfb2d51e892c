"""One admitted request's generation, and its engine calls: one call, or n calls fanned out.

By default a request's n samples are one engine call, which the engine answers with n outputs or
n interleaved streams, each increment naming its sample's `index`. With
`gateway.fan_out_n` they are n calls of one sample each (for engines whose unload can deadlock
after n > 1 sampling: see the setting). Either way the caller sees the samples in order, and when one
fails or the client leaves, every other call of the request ends too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.logprobs import policy_temperature
from tandem_inference.engines.base import Engine, Generated, Sampling
from tandem_inference.gateway.capacity import Permit
from tandem_inference.gateway.run_quota import RunPermit, unbounded
from tandem_inference.gateway.schemas import Kind
from tandem_inference.routing import Route, VersionHold


@dataclass(frozen=True)
class Generation:
    """A request admitted to the engine: what it asks for, and the version and room it holds
    until `release()` (once its reply, or its stream, ends)."""

    kind: Kind
    input_ids: list[int]
    sampling: Sampling
    n: int
    logprobs: bool
    """Whether the reply lists token logprobs."""
    hold: VersionHold
    permit: Permit
    turn: RunPermit = field(default_factory=unbounded)
    """The turn of its run it holds (run_quota.py); the base model's requests take none."""

    @property
    def route(self) -> Route:
        return self.hold.route

    @property
    def policy_temperature(self) -> float:
        """The temperature whose distribution the engine's logprobs are under (1 for greedy)."""
        return policy_temperature(self.sampling.temperature)

    def release(self) -> None:
        """Give back the version's in-flight count, the room and the run's turn; releasing twice is harmless."""
        self.hold.release()
        self.permit.release()
        self.turn.release()


async def generate(engine: Engine, gen: Generation, *, fan_out: bool) -> list[Generated]:
    """The n samples, whole, in order: one call, or n calls with `fan_out`."""
    adapter = gen.route.adapter
    if gen.n == 1 or not fan_out:
        return await engine.complete(gen.input_ids, gen.sampling, n=gen.n, adapter=adapter)
    calls = [asyncio.ensure_future(engine.complete(gen.input_ids, gen.sampling, adapter=adapter))
             for _ in range(gen.n)]
    try:
        return [replace(one, index=i) for i, (one,) in enumerate(await asyncio.gather(*calls))]
    finally:  # one sample failed (or the client left): the others stop too
        for call in calls:
            call.cancel()
        await asyncio.shield(asyncio.gather(*calls, return_exceptions=True))


def stream(engine: Engine, gen: Generation, *, fan_out: bool) -> AsyncGenerator[Generated, None]:
    """Increments of the n samples, each naming its sample: one call, or n with `fan_out`."""
    adapter, n = gen.route.adapter, gen.n
    if n > 1 and fan_out:
        return _merge([engine.stream(gen.input_ids, gen.sampling, adapter=adapter) for _ in range(n)])
    return engine.stream(gen.input_ids, gen.sampling, n=n, adapter=adapter)


async def _merge(streams: list[AsyncIterator[Generated]]) -> AsyncGenerator[Generated, None]:
    """Interleave several one-sample streams, the i-th as sample i; the first error ends all of them."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Generated]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                item.index = i
                yield item
    finally:
        for t in tasks:
            t.cancel()
        # Shielded: a second cancel (the stream's own, repeated by anyio while its client is gone)
        # would interrupt the pumps as they close their engine calls, leaving the engine generating.
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
