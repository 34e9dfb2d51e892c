"""Streamed replies: server-sent events of OpenAI chunks, ended at once when the client leaves.

The first event is awaited before the response starts, so an engine error before the first
token keeps its HTTP status; an error after it is sent as an error event, then `[DONE]`. The
request's version and room are held until the stream ends, however it ends. A chat with tools
streams its calls as OpenAI does (`tool_calls` deltas, `finish_reason: tool_calls`; see
`tool_calls.StreamedCalls`). The last choice's finish carries the `tandem` extension (token ids and
logprobs for training); with `stream_options.include_usage` a last chunk without choices follows,
with the usage and the extension, as OpenAI sends it (never otherwise: a client reading
`chunk.choices[0]` would fail on it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.errors import TandemError
from tandem_inference.engines.base import Engine
from tandem_inference.errors import EngineUnreachable
from tandem_inference.gateway import generation
from tandem_inference.gateway.error_replies import for_clients
from tandem_inference.gateway.generation import Generation
from tandem_inference.gateway.outputs import Output, usage
from tandem_inference.gateway.responses import ResponseFormat
from tandem_inference.gateway.schemas import Kind
from tandem_inference.gateway.tool_calls import StreamedCalls

log = logging.getLogger(__name__)


async def stream_reply(
    engine: Engine, gen: Generation, fmt: ResponseFormat, *, fan_out: bool, headers: dict[str, str],
    on_client_left: Callable[[], None], tools: Collection[str] = (), include_usage: bool = False,
) -> EventStream:
    """The streamed reply of `gen` (a chat's calls of `tools` as `tool_calls` deltas); engine
    errors before the first token are raised here."""
    events = _events(engine, gen, fmt, fan_out=fan_out, tools=tools, include_usage=include_usage)
    try:
        first = await events.__anext__()  # engine errors before the first token keep their status
    except BaseException:
        gen.release()
        await events.aclose()
        raise
    return EventStream(first, events, headers={**headers, "cache-control": "no-cache"}, on_client_left=on_client_left)


async def _events(engine: Engine, gen: Generation, fmt: ResponseFormat, *, fan_out: bool,
                  tools: Collection[str], include_usage: bool) -> AsyncGenerator[str, None]:
    kind, n, route = gen.kind, gen.n, gen.route
    calls = [StreamedCalls(tools if kind == "chat" else ()) for _ in range(n)]
    envelope = fmt.envelope(kind, route, stream=True)
    tag = {"run": route.run, "version": route.version}
    outputs = [Output() for _ in range(n)]
    finished = [False] * n

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return "data: " + json.dumps({**envelope, "choices": choices, "tandem": tag, **extra}) + "\n\n"

    def finish(i: int, reason: str) -> list[str]:
        """Choice `i`'s last chunks; the last choice to finish carries the extension on its finish."""
        finished[i] = True
        events = _finished(fmt, kind, i, outputs[i], calls[i], reason, gen.logprobs)
        last = [] if not all(finished) else [chunk([events.pop()], tandem=extension())]
        return [chunk([event]) for event in events] + last

    def extension() -> dict[str, Any]:
        return fmt.extension(route, gen.input_ids, outputs, gen.policy_temperature)

    merged = generation.stream(engine, gen, fan_out=fan_out)
    try:
        started = False
        async for new in merged:
            i = new.index
            out = outputs[i]
            delta, start = out.update(new)
            if not started and kind == "chat":
                started = True
                yield chunk(fmt.role(n))
            started = True
            if delta or start < len(out.token_ids):
                content = calls[i].feed(delta, start)
                if content or calls[i].held_from_token is None:  # a fully held piece waits for the end
                    yield chunk([fmt.delta(kind, i, out, content, start, gen.logprobs)])
            if out.finish_reason and not finished[i]:
                for text in finish(i, out.finish_reason):
                    yield text
        for i, done in enumerate(finished):
            if not done:
                for text in finish(i, "stop"):
                    yield text
        if include_usage:
            yield chunk([], usage=usage(gen.input_ids, outputs), tandem=extension())
    except TandemError as exc:
        if not started:
            raise
        status = 503 if isinstance(exc, EngineUnreachable) else 502
        log.warning("stream on %s failed after it started: %s", route.name(fmt.base_model), exc)
        error = {"error": {"message": for_clients(exc), "type": "engine_error", "code": status}}
        yield "data: " + json.dumps(error) + "\n\n"
    finally:
        gen.release()
        await merged.aclose()
    yield "data: [DONE]\n\n"


def _finished(fmt: ResponseFormat, kind: Kind, i: int, out: Output, calls: StreamedCalls, reason: str,
              logprobs: bool) -> list[dict[str, Any]]:
    """The last events of choice `i`: its held text let out, or its tool calls, then its finish."""
    held_from = calls.held_from_token
    content, tool_deltas = calls.finish()
    events = []
    if content:
        events.append(fmt.delta(kind, i, out, content, held_from if held_from is not None else len(out.token_ids),
                                logprobs and not tool_deltas))
    for tool_delta in tool_deltas:
        events.append({"index": i, "delta": {"tool_calls": [tool_delta]}, "logprobs": None, "finish_reason": None})
    events.append(fmt.finish(kind, i, "tool_calls" if tool_deltas else reason))
    return events


class EventStream(StreamingResponse):
    """An SSE response that ends, and closes its engine calls, as soon as its client leaves.

    It listens for the disconnect whatever ASGI version the server speaks (under 2.4 Starlette
    would notice a client gone only when a chunk fails to send, so a stream waiting on the
    engine would go on generating for nobody), counts the client's leaving, and closes its
    event source however it ends, started or not, shielded from the cancellation that ended it.
    """

    def __init__(self, first: str, events: AsyncGenerator[str, None], *, headers: dict[str, str],
                 on_client_left: Callable[[], None]) -> None:
        async def body() -> AsyncIterator[str]:
            yield first
            async for item in events:
                yield item

        super().__init__(body(), media_type="text/event-stream", headers=headers)
        self._events = events
        self._on_client_left = on_client_left

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    nonlocal finished
                    try:
                        await self.stream_response(send)
                        finished = True
                    except OSError:  # the client left mid-send
                        self._on_client_left()
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                if not finished:
                    self._on_client_left()
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
