"""Scenario 4, gateway overhead: the same closed-loop load through tandem's gateway and
straight to the engine (its OpenAI route, `model = "<served>:<adapter>"`), in rounds ordered
direct, gateway, gateway, direct (ABBA) so that drift hits both alike. The client sends the same
OpenAI request both ways; the gateway serves it through the engine's native /generate, as it
always does, so the comparison is what a user of either path sees.
The goal: gateway throughput at least 97% of direct.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

from bench.benchlib import Ctx, Sample, closed_loop, goal, md_table, new_version, summary
from tandem.runs import adapter_name

PROMPT = "Write some numbers."


def send_to(url_model: str, headers: dict[str, str]) -> Any:
    def send(http: httpx.Client, i: int) -> Sample:
        start = time.time()
        body = {"model": url_model, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
        try:
            resp = http.post("/v1/completions", json=body, headers=headers)
        except httpx.HTTPError as exc:
            return Sample(i, start, time.time(), None, False, error=str(exc))
        ok = resp.status_code == 200
        tokens = resp.json()["usage"]["completion_tokens"] if ok else 0
        return Sample(i, start, time.time(), None, ok, status=resp.status_code, tokens=tokens,
                      error="" if ok else resp.text[:200])

    return send


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None and ctx.client is not None
    clients = 4
    per_client = 8 if ctx.quick else 30
    rounds = 1 if ctx.quick else 2
    version = ctx.client.registry.serving(ctx.run_name)
    if version == 0:  # run alone (--only gateway): make one version to aim both paths at
        version = new_version(ctx.client.run(ctx.run_name))
        ctx.progress(f"trained v{version} for both paths to use")
    engine_key = os.environ.get("TANDEM_ENGINE__API_KEY") or ctx.engine_env.get("TANDEM_ENGINE__API_KEY")
    engine_headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
    targets = {
        # the same adapter both ways: the gateway resolves the pinned version, the engine is told it
        "gateway": (ctx.stack.gateway_url, f"{ctx.run_name}@v{version}", {}),
        "direct": (ctx.stack.engine_url, f"{ctx.served_model}:{adapter_name(ctx.run_name, version)}", engine_headers),
    }
    results: dict[str, list[Sample]] = {"gateway": [], "direct": []}
    walls: dict[str, float] = {"gateway": 0.0, "direct": 0.0}
    for url, model, headers in targets.values():  # warm both paths
        closed_loop(send_to(model, headers), clients=clients, requests_per_client=2, base_url=url)
    for r in range(rounds):
        for name in ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct"):  # ABBA
            url, model, headers = targets[name]
            t0 = time.time()
            results[name] += closed_loop(send_to(model, headers), clients=clients, requests_per_client=per_client,
                                         base_url=url)
            walls[name] += time.time() - t0
            ctx.progress(f"round {r + 1}/{rounds}: {name} done ({clients} clients x {per_client} requests)")
    stats = {}
    for name, samples in results.items():
        ok = [s for s in samples if s.ok]
        stats[name] = {
            "requests": len(samples), "errors": len(samples) - len(ok),
            "throughput_rps": len(ok) / walls[name] if walls[name] else 0.0,
            "latency_ms": summary([(s.end - s.start) * 1000 for s in ok]),
        }
    ratio = _ratio(stats["gateway"]["throughput_rps"], stats["direct"]["throughput_rps"])
    p50_ratio = _ratio(stats["gateway"]["latency_ms"]["p50"], stats["direct"]["latency_ms"]["p50"])
    goals = [goal("gateway throughput / direct", ratio, 0.97, at_most=False),
             goal("failed requests (both paths)", float(stats["gateway"]["errors"] + stats["direct"]["errors"]), 0.0)]
    table = md_table(
        ["path", "requests", "errors", "req/s", "latency p50 ms", "p95 ms"],
        [[n, s["requests"], s["errors"], s["throughput_rps"], s["latency_ms"]["p50"], s["latency_ms"]["p95"]]
         for n, s in stats.items()])
    table += f"\n\nthroughput ratio gateway/direct {ratio:.3f}; p50 latency ratio {p50_ratio:.3f}."
    if ctx.engine == "transformers":
        table += (" On a 2-core CPU the gateway process competes with the engine for the same cores, so the "
                  "ratio here includes CPU contention that separate cores would not have.")
    return {"name": "gateway", "title": "4. Gateway overhead", "summary": {**stats, "throughput_ratio": ratio,
            "p50_latency_ratio": p50_ratio}, "rows": [], "goals": goals, "table": table, "plots": []}


def _ratio(a: float, b: float) -> float:
    """a / b, or 0 when the direct path served nothing (its failures are reported as such)."""
    return a / b if b else 0.0
