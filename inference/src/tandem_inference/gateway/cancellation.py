"""Replies that are not streamed, ended as soon as their client leaves.

An unstreamed generation runs beside a watch on the client's connection: if the client goes
first, the generation is cancelled (its engine calls closed, its version and room released)
and `ClientLeft` raised, so the engine stops generating for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from tandem_inference.bodies import client_left
from tandem_inference.errors import ClientLeft

T = TypeVar("T")


async def unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, unless the client leaves first: then `work` is cancelled and ClientLeft raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_left(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        gone.cancel()
        raise
    if task.done():
        gone.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientLeft(f"the client left {request.url.path} before its response")
