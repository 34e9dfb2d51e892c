"""A loopback proxy in front of an engine that counts its generate calls in flight per adapter and the
adapters it holds per run, and holds the calls of chosen runs until it is told to let them through.

A test of the gateway's quotas puts it between the gateway and the transformers engine: what the
engine is asked at once, per run, is then seen from outside the gateway, and a run's calls can be
kept in flight for as long as the test needs to look.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from helpers.loopback import HOP_BY_HOP, serve_app


@dataclass
class Gate:
    """What the proxy saw, and the switch that lets held calls through."""

    url: str = ""
    held_runs: set[str] = field(default_factory=set)
    """Runs whose generate calls wait at the proxy until `release` is set."""
    release: threading.Event = field(default_factory=threading.Event)
    in_flight: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Generate calls in flight per run (the adapter name's `<run>-v` prefix), samples counted."""
    peak: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """The most samples each run had in flight at the engine at once."""
    served: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Generate calls each run had answered by the engine."""
    adapters: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Adapters each run has in the engine: from the start of a load to the end of its unload (so
    never fewer than the engine holds)."""
    peak_adapters: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """The most adapters each run had in the engine at once."""
    unloaded: list[str] = field(default_factory=list)
    """Adapters the engine unloaded, in order."""
    lock: threading.Lock = field(default_factory=threading.Lock)


def _adapter_run(name: object) -> str:
    return name.rsplit("-v", 1)[0] if isinstance(name, str) else ""


def _run_of(body: dict[str, Any]) -> tuple[str, int]:
    """The run a /generate body's adapter belongs to ('' for the base model), and its samples."""
    adapter = body.get("lora_path")
    adapter = adapter[0] if isinstance(adapter, list) and adapter else adapter
    run = _adapter_run(adapter)
    n = (body.get("sampling_params") or {}).get("n", 1)
    return run, int(n) if isinstance(n, int) else 1


@contextmanager
def gate_proxy(target: str) -> Iterator[Gate]:
    """Serve the proxy to `target`; yields its Gate (its `url` set). Held calls go through at the end."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    gate = Gate()

    async def forward(request: Request) -> Response:
        content = await request.body()
        run, n, path = "", 0, request.url.path
        name = json.loads(content).get("lora_name") if path in ("/load_lora_adapter", "/unload_lora_adapter") else None
        if path == "/load_lora_adapter":
            with gate.lock:
                gate.adapters[_adapter_run(name)].add(str(name))
                gate.peak_adapters[_adapter_run(name)] = max(gate.peak_adapters[_adapter_run(name)],
                                                             len(gate.adapters[_adapter_run(name)]))
        if path == "/generate":
            run, n = _run_of(json.loads(content))
            with gate.lock:
                gate.in_flight[run] += n
                gate.peak[run] = max(gate.peak[run], gate.in_flight[run])
        try:
            if run in gate.held_runs:
                await asyncio.to_thread(gate.release.wait, 120)
            async with httpx.AsyncClient(base_url=target, timeout=120) as client:
                upstream = await client.request(
                    request.method, request.url.path, params=request.query_params, content=content,
                    headers={k: v for k, v in request.headers.items() if k.lower() != "host"})
        finally:
            if n:
                with gate.lock:
                    gate.in_flight[run] -= n
        with gate.lock:
            if n:
                gate.served[run] += 1
            if path == "/load_lora_adapter" and upstream.status_code != 200:
                gate.adapters[_adapter_run(name)].discard(str(name))
            if path == "/unload_lora_adapter" and upstream.status_code == 200:
                gate.adapters[_adapter_run(name)].discard(str(name))
                gate.unloaded.append(str(name))
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return Response(upstream.content, status_code=upstream.status_code, headers=headers)

    methods = ["GET", "POST", "PUT", "DELETE"]
    with serve_app(Starlette(routes=[Route("/{path:path}", forward, methods=methods)])) as url:
        gate.url = url
        try:
            yield gate
        finally:
            gate.release.set()
