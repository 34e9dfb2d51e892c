"""The bridge between the event loop and the runtime's worker threads, with the set of cancels.

Generation blocks on the model, so it runs in worker threads while the loop stays free.
Every running request has a cancel event: it is set when the request's time is up
(engine.generate_timeout_s), when its client leaves (as SGLang does), and for all of them at
once by `/update_weights_from_disk` with `abort_all_requests`. A cancelled request ends with
finish_reason "abort" at its next token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from tandem_inference.bodies import client_left
from tandem_inference.engines.transformers.metrics import EngineMetrics
from tandem_inference.engines.transformers.runtime import HFEngine, Job
from tandem_inference.engines.transformers.sampling import SamplingParams, Sequence

Step = tuple[int, Sequence]
"""One streamed snapshot: the choice index (job * n + sample) and the sequence so far."""


class Generations:
    """Runs generations for the event loop and holds the cancel event of each one running."""

    def __init__(self, metrics: EngineMetrics, *, timeout_s: float) -> None:
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.running: set[threading.Event] = set()

    def cancel_all(self) -> None:
        """End every running generation at its next token."""
        for cancel in list(self.running):
            cancel.set()

    def prepare(self, engine: HFEngine, jobs: list[Job], params: SamplingParams) -> None:
        """Fail fast (HTTP 400/503 before any streaming starts) on what can be checked now."""
        engine.check_jobs(jobs, params)
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in jobs) * params.n)

    async def run_all(
        self, engine: HFEngine, jobs: list[Job], params: SamplingParams, request: Request | None = None
    ) -> list[list[Sequence]]:
        """Generate every job; when the client of `request` leaves, the rest is aborted."""
        self.prepare(engine, jobs, params)
        cancel = threading.Event()
        self.running.add(cancel)
        timer = asyncio.get_running_loop().call_later(self.timeout_s, cancel.set)
        watch = asyncio.ensure_future(_on_disconnect(request, cancel.set)) if request is not None else None
        try:
            results = await asyncio.to_thread(
                lambda: [engine.generate(ids, params, adapter, cancel=cancel) for ids, adapter in jobs]
            )
        finally:
            if watch is not None:
                watch.cancel()
            timer.cancel()
            cancel.set()
            self.running.discard(cancel)
        for seqs in results:
            self.metrics.count(seqs)
        return results

    def stream(self, engine: HFEngine, jobs: list[Job], params: SamplingParams) -> AsyncIterator[Step]:
        """Check now (so bad input is an HTTP error), then stream (choice index, snapshot) pairs."""
        self.prepare(engine, jobs, params)
        return self._advance(engine, jobs, params)

    async def _advance(self, engine: HFEngine, jobs: list[Job], params: SamplingParams) -> AsyncIterator[Step]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Step | Exception | None] = asyncio.Queue()  # None: the end
        cancel = threading.Event()

        def put(item: Step | Exception | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                for k, (ids, adapter) in enumerate(jobs):
                    on_step = _snapshots(k * params.n, put)
                    self.metrics.count(engine.generate(ids, params, adapter, on_step=on_step, cancel=cancel))
                put(None)
            except Exception as exc:  # noqa: BLE001 - handed to the stream, reported as an error event
                put(exc)

        timer = loop.call_later(self.timeout_s, cancel.set)
        self.running.add(cancel)
        loop.run_in_executor(None, work)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:  # also when the client goes away: the worker stops at its next token
            timer.cancel()
            cancel.set()
            self.running.discard(cancel)


def _snapshots(first: int, put: Callable[[Step], None]) -> Callable[[list[Sequence]], None]:
    """An `on_step` that puts a copy of each sequence that grew, as choice `first + j`."""
    sent: list[int] = []

    def on_step(seqs: list[Sequence]) -> None:
        sent.extend([0] * (len(seqs) - len(sent)))
        for j, s in enumerate(seqs):
            if len(s.output_ids) > sent[j]:  # a new token (the last one ends it)
                sent[j] = len(s.output_ids)
                snap = dataclasses.replace(
                    s, output_ids=list(s.output_ids), logprobs=list(s.logprobs), top_logprobs=list(s.top_logprobs)
                )
                put((first + j, snap))

    return on_step


async def _on_disconnect(request: Request, then: Callable[[], None]) -> None:
    """Call `then` once the client of `request` is gone."""
    await client_left(request)
    then()
