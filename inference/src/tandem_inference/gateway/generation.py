"""One admitted request's generation, and its engine calls: one call, or n calls fanned out.

By default a request's n samples are one engine call (`sampling_params.n`), which the engine
answers with n outputs or n interleaved streams, each chunk naming its sample's `index`. With
`gateway.fan_out_n` they are n calls of one sample each (SGLang's unload can deadlock after
n>1 sampling, sglang#36894). Either way the caller sees the samples in order, and when one
fails or the client leaves, every other call of the request ends too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from tandem.logprobs import policy_temperature
from tandem_inference.capacity import Permit
from tandem_inference.engine_client import EngineClient
from tandem_inference.errors import EngineResponseError
from tandem_inference.gateway.schemas import Kind
from tandem_inference.routing import Route, VersionHold


@dataclass(frozen=True)
class Generation:
    """A request admitted to the engine: what it asks for, and the version and room it holds
    until `release()` (once its reply, or its stream, ends)."""

    kind: Kind
    input_ids: list[int]
    params: dict[str, Any]
    """Sampling parameters of /generate (max_new_tokens, temperature, top_p, stop, ...)."""
    n: int
    logprobs: bool
    """Whether the reply lists token logprobs."""
    hold: VersionHold
    permit: Permit

    @property
    def route(self) -> Route:
        return self.hold.route

    @property
    def policy_temperature(self) -> float:
        """The temperature whose distribution the engine's logprobs are under (1 for greedy)."""
        return policy_temperature(self.params.get("temperature"))

    def release(self) -> None:
        """Give back the version's in-flight count and the room; releasing twice is harmless."""
        self.hold.release()
        self.permit.release()


async def generate(engine: EngineClient, gen: Generation, *, fan_out: bool) -> list[dict[str, Any]]:
    """The engine outputs of the n samples, in order: one call, or n calls with `fan_out`."""
    adapter = gen.route.adapter
    if gen.n == 1 or not fan_out:
        return await engine.generate_n(gen.input_ids, gen.params, gen.n, adapter)
    calls = [asyncio.ensure_future(engine.generate(gen.input_ids, gen.params, adapter)) for _ in range(gen.n)]
    try:
        return list(await asyncio.gather(*calls))
    finally:  # one sample failed (or the client left): the others stop too
        for call in calls:
            call.cancel()
        await asyncio.shield(asyncio.gather(*calls, return_exceptions=True))


def stream(engine: EngineClient, gen: Generation, *, fan_out: bool) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """The engine chunks of the n samples as (sample index, chunk): one call, or n with `fan_out`."""
    adapter, n = gen.route.adapter, gen.n
    if n > 1 and fan_out:
        return _merge([engine.generate_stream(gen.input_ids, gen.params, adapter) for _ in range(n)])
    params = {**gen.params, "n": n} if n > 1 else gen.params
    return _indexed(engine.generate_stream(gen.input_ids, params, adapter), n)


async def _indexed(
    stream: AsyncGenerator[dict[str, Any], None], n: int,
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """One engine stream of n samples as (sample index, chunk): each chunk names its `index`."""
    async with contextlib.aclosing(stream) as chunks:
        async for chunk in chunks:
            i = chunk.get("index", 0) if n > 1 else 0
            if not isinstance(i, int) or not 0 <= i < n:
                raise EngineResponseError(f"the engine streamed a chunk of sample {i!r}, expected 0..{n - 1}",
                                          status_code=200)
            yield i, chunk


async def _merge(
    streams: list[AsyncIterator[dict[str, Any]]],
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """Interleave several engine streams as (index, chunk); the first error ends all of them."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[dict[str, Any]]) -> None:
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
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # Shielded: a second cancel (the stream's own, repeated by anyio while its client is gone)
        # would interrupt the pumps as they close their engine calls, leaving the engine generating.
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
