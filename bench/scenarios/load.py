"""Scenario 7, the gateway under load: more generation than the engine can take at once, and
what a small request and /ready see meanwhile.

Enough clients to fill the gateway's budget (gateway.max_in_flight_*) and its queue
(gateway.max_queued_requests) send requests of n samples back to back; a refused client waits
its Retry-After before the next. A probe sends a small request (one sample, 4 tokens) and a
GET /ready every half second, first alone (the baseline), then under the load. Each small
request notes whether the oldest waiter had waited half of gateway.queue_timeout_s when it was
sent (tandem_gateway_queue_oldest_wait_seconds): then that large request is overdue and the
small one may pass it only within its allowance (gateway/capacity.py), so the small request's
latency is reported apart for the two cases. The suite runs the gateway with a queue timeout
short enough (suite.QUEUE_TIMEOUT_S) for the queue's head to turn overdue within the scenario. When
the time is up the clients leave mid-request, and the scenario measures how long the gateway
takes to hold nothing again: their engine calls are closed, not run for nobody.
Goals: the small request and /ready stay bounded, also while a large request is overdue,
/ready never fails, only 200 and 429 come back, and the load is refused in part (otherwise it
did not saturate the gateway).
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx

from bench.benchlib import Ctx, goal, md_table, plt, save_figure, summary
from tandem.dev.toy import PROMPTS
from tandem.settings import GatewaySettings

N = 8
SMALL = {"prompt": "1 2 3", "max_tokens": 4, "temperature": 0}
PROBE_EVERY_S = 0.5


def budget(ctx: Ctx) -> dict[str, float]:
    """The gateway's admission settings as the stack runs them (its env over the defaults)."""
    env = {k.removeprefix("TANDEM_GATEWAY__").lower(): v for k, v in ctx.engine_env.items()
           if k.startswith("TANDEM_GATEWAY__")}
    gw = GatewaySettings.model_validate({k: v for k, v in env.items() if k in GatewaySettings.model_fields})
    return {"max_in_flight_sequences": gw.max_in_flight_sequences, "max_in_flight_tokens": gw.max_in_flight_tokens,
            "max_queued_requests": gw.max_queued_requests, "queue_timeout_s": gw.queue_timeout_s}


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None
    limits = budget(ctx)
    max_tokens = 64 if ctx.engine == "transformers" else 256
    admitted = max(1, min(limits["max_in_flight_sequences"] // N, limits["max_in_flight_tokens"] // (N * max_tokens)))
    clients = int(admitted + limits["max_queued_requests"] + max(16, admitted))
    duration_s = 8.0 if ctx.quick else 20.0
    ctx.progress(f"{clients} clients x (n={N}, max_tokens={max_tokens}) for {duration_s:.0f} s; about {admitted} "
                 f"fit the budget at once, {limits['max_queued_requests']} may queue")
    out = asyncio.run(_drive(ctx.stack.gateway_url, ctx.served_model, clients, max_tokens, duration_s,
                             limits["queue_timeout_s"] / 2))
    return report(ctx, out, limits, clients, max_tokens, duration_s)


async def _drive(url: str, model: str, clients: int, max_tokens: int, duration_s: float,
                 overdue_s: float) -> dict[str, Any]:
    probes: list[dict[str, Any]] = []
    load: list[dict[str, Any]] = []
    t0 = time.time()

    async def probe(http: httpx.AsyncClient, phase: str, until: float) -> None:
        """A small request and a /ready every PROBE_EVERY_S each (neither waits for the other)."""

        async def one(kind: str) -> None:
            while (start := time.time()) < until:
                row: dict[str, Any] = {"phase": phase, "kind": kind, "t": start - t0}
                try:
                    if kind == "small":
                        oldest = _sample((await http.get("/metrics")).text, "tandem_gateway_queue_oldest_wait_seconds")
                        row.update(oldest_wait_s=oldest, overdue=oldest >= overdue_s)
                        start = time.time()
                        resp = await http.post("/v1/completions", json={"model": model, **SMALL})
                    else:
                        resp = await http.get("/ready")
                    row["status"] = resp.status_code
                except httpx.HTTPError as exc:
                    row.update(status=0, error=f"{type(exc).__name__}: {exc}"[:200])
                row["latency_s"] = time.time() - start
                probes.append(row)
                await asyncio.sleep(max(0.0, PROBE_EVERY_S - row["latency_s"]))

        await asyncio.gather(one("small"), one("ready"))

    async def client(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "n": N}
        while True:
            start = time.time()
            try:
                resp = await http.post("/v1/completions", json=body)
            except httpx.HTTPError as exc:
                load.append({"t": start - t0, "end": time.time() - t0, "status": 0, "error": str(exc)[:200]})
                continue
            load.append({"t": start - t0, "end": time.time() - t0, "status": resp.status_code})
            if resp.status_code == 429:
                await asyncio.sleep(float(resp.headers.get("retry-after", "1")))

    async with httpx.AsyncClient(base_url=url, timeout=120) as probe_http:
        await probe(probe_http, "idle", time.time() + 3)
        load_start = time.time() - t0
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=None)) as http:
            tasks = [asyncio.create_task(client(http, i)) for i in range(clients)]
            await probe(probe_http, "load", time.time() + duration_s)
            stopped = time.time()
            for task in tasks:  # the clients leave mid-request: their connections close
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        drained = None
        while time.time() - stopped < 60:
            text = (await probe_http.get("/metrics")).text
            if _sample(text, "tandem_gateway_in_flight_tokens") == 0 and _sample(text, "tandem_gateway_queued_requests") == 0:
                drained = time.time() - stopped
                break
            await asyncio.sleep(0.1)
        text = (await probe_http.get("/metrics")).text
    return {"probes": probes, "load": load, "load_start_s": load_start, "load_end_s": stopped - t0,
            "drained_s": drained, "refused": {r: _sample(text, "tandem_gateway_refused_total", f'reason="{r}"')
                                              for r in ("queue_full", "queue_timeout")},
            "cancelled": _sample(text, "tandem_gateway_cancelled_total", 'route="/v1/completions"')}


def _sample(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def report(ctx: Ctx, out: dict[str, Any], limits: dict[str, float], clients: int, max_tokens: int,
           duration_s: float) -> dict[str, Any]:
    probes, load = out["probes"], out["load"]

    def latencies(phase: str, kind: str, overdue: bool | None = None) -> list[float]:
        """Latencies of the probes that succeeded; for small ones under load, those sent while the
        queue's head was overdue (True) or not (False), or all of them (None)."""
        return [p["latency_s"] for p in probes if p["phase"] == phase and p["kind"] == kind and p["status"] == 200
                and (overdue is None or p.get("overdue") is overdue)]

    small_idle, small_load = summary(latencies("idle", "small")), summary(latencies("load", "small"))
    small_calm, small_overdue = summary(latencies("load", "small", False)), summary(latencies("load", "small", True))
    ready_idle, ready_load = summary(latencies("idle", "ready")), summary(latencies("load", "ready"))
    probe_failures = [p for p in probes if p["status"] != 200]
    served = sum(r["status"] == 200 for r in load)
    refused = sum(r["status"] == 429 for r in load)
    other = [r for r in load if r["status"] not in (200, 429)]
    share = refused / len(load) if load else 0.0
    s = {"clients": clients, "n": N, "max_tokens": max_tokens, "duration_s": duration_s, "budget": limits,
         "attempts": len(load), "served": served, "refused": refused, "refused_share": share,
         "refused_by_reason": out["refused"], "other_statuses": len(other),
         "served_per_s": served / duration_s, "small_idle_s": small_idle, "small_load_s": small_load,
         "small_load_none_overdue_s": small_calm, "small_load_overdue_s": small_overdue,
         "largest_oldest_wait_s": max((p["oldest_wait_s"] for p in probes if "oldest_wait_s" in p), default=0.0),
         "ready_idle_s": ready_idle, "ready_load_s": ready_load, "probe_failures": len(probe_failures),
         "cancelled_when_clients_left": out["cancelled"], "drained_after_clients_left_s": out["drained_s"],
         "load_start_s": out["load_start_s"], "load_end_s": out["load_end_s"]}
    small_target = 10.0 if ctx.engine == "transformers" else 2.0
    drained = out["drained_s"] if out["drained_s"] is not None else float("inf")
    goals = [
        goal("small request p95 while saturated, s", small_load["p95"], small_target),
        goal("small request p95 while saturated and a large request overdue, s", small_overdue["p95"], small_target,
             note="" if small_overdue["n"] else "no small request was sent while one was overdue"),
        goal("/ready p95 while saturated, s", ready_load["p95"], 1.0),
        goal("probes that failed (small request or /ready)", float(len(probe_failures)), 0.0),
        goal("load responses other than 200 and 429", float(len(other)), 0.0),
        goal("share of the load refused with 429 (saturated)", share, 0.01, at_most=False),
        goal("gateway idle after the clients left, s", drained, 10.0),
    ]
    plot_name = "load.png"
    plot({"probes": probes, "load": load, "summary": s}, ctx.out / plot_name)
    overdue_s = limits["queue_timeout_s"] / 2
    table = md_table(
        ["", "small requests", "small request p50 / p95 / max s", "/ready p50 / p95 / max s"],
        [["idle", small_idle["n"], _three(small_idle), _three(ready_idle)],
         ["saturated", small_load["n"], _three(small_load), _three(ready_load)],
         [f"… the queue's head waited < {overdue_s:g} s", small_calm["n"], _three(small_calm), ""],
         [f"… the queue's head overdue (waited ≥ {overdue_s:g} s)", small_overdue["n"], _three(small_overdue), ""]])
    table += "\n\n" + md_table(
        ["clients", "attempts", "served (200)", "refused (429)", "refused share", "other", "served req/s",
         "idle after clients left s"],
        [[clients, len(load), served, refused, share, len(other), served / duration_s, drained]])
    table += (f"\n\nEach load request: n={N}, max_tokens={max_tokens} ({N * max_tokens} tokens of budget). Budget: "
              f"{limits['max_in_flight_sequences']:g} sequences, {limits['max_in_flight_tokens']:g} tokens, "
              f"queue {limits['max_queued_requests']:g} requests for {limits['queue_timeout_s']:g} s. Refused: "
              f"{out['refused']['queue_full']:g} with the queue full, {out['refused']['queue_timeout']:g} after "
              f"waiting; {out['cancelled']:g} requests cancelled when the clients left.")
    if probe_failures:
        table += "\n\nProbe failures: " + "; ".join(sorted({f"{p['kind']} {p['status']} {p.get('error', '')}"
                                                            for p in probe_failures})[:3])
    return {"name": "load", "title": "7. The gateway under load", "summary": s,
            "rows": {"probes": probes, "load": load}, "goals": goals, "table": table, "plots": [plot_name]}


def _three(s: dict[str, float]) -> str:
    return f"{s['p50']:.2f} / {s['p95']:.2f} / {s['max']:.2f}"


def plot(data: dict[str, Any], path: Path) -> None:
    pyplot = plt()
    probes, load, s = data["probes"], data["load"], data["summary"]
    fig, (top, bottom) = pyplot.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    for kind, color in (("small", "#4c72b0"), ("ready", "#55a868")):
        pts = [p for p in probes if p["kind"] == kind]
        top.plot([p["t"] for p in pts], [p["latency_s"] for p in pts], "o-", ms=3, color=color,
                 label="small request (4 tokens)" if kind == "small" else "GET /ready")
    overdue = [p for p in probes if p.get("overdue")]
    top.plot([p["t"] for p in overdue], [p["latency_s"] for p in overdue], "o", ms=6, mfc="none", color="#c44e52",
             label="… sent while the queue's head was overdue")
    top.set_yscale("log")
    top.set_ylabel("latency, s")
    top.legend(loc="upper left", fontsize=8)
    top.set_title("A small request and /ready while the gateway is saturated")
    end = int(max([r["end"] for r in load], default=0)) + 1
    served, refused = [0] * (end + 1), [0] * (end + 1)
    for r in load:
        if r["status"] == 200:
            served[int(r["end"])] += 1
        elif r["status"] == 429:
            refused[int(r["end"])] += 1
    bottom.bar(range(end + 1), served, width=1.0, align="edge", color="#4c72b0", label="served (200)")
    bottom.bar(range(end + 1), refused, width=1.0, align="edge", bottom=served, color="#c44e52", label="refused (429)")
    bottom.set_ylabel("load responses per s")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper left", fontsize=8)
    for ax in (top, bottom):
        ax.axvspan(s["load_start_s"], s["load_end_s"], color="#999999", alpha=0.12)
    save_figure(fig, path)


def replot(result: dict[str, Any], out: Path) -> None:
    plot({**result["rows"], "summary": result["summary"]}, out / "load.png")
