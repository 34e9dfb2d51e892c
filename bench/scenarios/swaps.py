"""Scenario 3, serving during swaps: concurrent clients stream rollouts through the gateway
while a new version is published every few seconds.

Reports throughput, time to first token and latency percentiles, errors (the goal is none),
and for every response the version that served it against the newest version serving when
the request was sent (from `adapter_loaded` in the event stream): no response may come from
a version older than that.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from bench.benchlib import Ctx, Sample, closed_loop, goal, md_table, new_version, plt, save_figure, stream_completion, summary
from tandem.dev.toy import PROMPTS
from tandem.events import EventKind


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None and ctx.client is not None
    clients = 2 if ctx.quick else 4
    duration_s = 10.0 if ctx.quick else 40.0
    interval_s = 2.0 if ctx.quick else 3.0
    run = ctx.client.run(ctx.run_name)
    published: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def publisher() -> None:
        try:
            while not stop.wait(interval_s):
                published.append(new_version(run))
                ctx.progress(f"published v{published[-1]} ({len(published)} swaps so far)")
        except BaseException as exc:  # noqa: BLE001 - reported by the scenario below
            failures.append(exc)

    newest_before = ctx.client.registry.serving(run.name)
    started = time.time()
    after = ctx.client.events.last_id()
    pub = threading.Thread(target=publisher, daemon=True)
    pub.start()

    def send(http: Any, i: int) -> Sample:
        body = {"model": run.name, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16, "temperature": 1.0}
        return stream_completion(http, "/v1/completions", body, i)

    ctx.progress(f"{clients} clients streaming for {duration_s:.0f} s, a new version every {interval_s:.0f} s")
    samples = closed_loop(send, clients=clients, duration_s=duration_s, base_url=ctx.stack.gateway_url)
    stop.set()
    pub.join(120)
    if failures:
        raise RuntimeError(f"publishing a new version failed during the run: {failures[0]}") from failures[0]
    wall = time.time() - started
    events = ctx.client.events.read(after, count=100_000)
    loads = sorted((e.ts, e.version) for e in events
                   if e.kind is EventKind.ADAPTER_LOADED and e.run == run.name and e.version is not None)

    def newest_at(t: float) -> int | None:
        v = None
        for ts, version in loads:
            if ts <= t:
                v = version
        return v if v is not None else newest_before

    rows = []
    for s in samples:
        newest = newest_at(s.start)
        lag = (newest - s.version) if (newest is not None and s.version is not None) else None
        rows.append({"client": s.client, "start": s.start - started, "end": s.end - started, "ttft_s": s.ttft,
                     "ok": s.ok, "status": s.status, "error": s.error, "version": s.version,
                     "newest_at_start": newest, "lag": lag, "tokens": s.tokens})
    ok = [r for r in rows if r["ok"]]
    errors = len(rows) - len(ok)
    older = [r for r in ok if r["lag"] is not None and r["lag"] > 0]
    lat = summary([(r["end"] - r["start"]) * 1000 for r in ok])
    ttft = summary([r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None])
    tokens = sum(r["tokens"] for r in ok)
    s = {
        "clients": clients, "duration_s": round(wall, 2), "requests": len(rows), "errors": errors,
        "swaps": len(loads), "throughput_rps": len(ok) / duration_s, "tokens_per_s": tokens / duration_s,
        "ttft_ms": ttft, "latency_ms": lat, "served_by_older_than_newest": len(older),
        "max_lag_versions": max((r["lag"] for r in ok if r["lag"] is not None), default=0),
        "swap_times_s": [round(ts - started, 3) for ts, _ in loads],
    }
    goals = [goal("failed requests during swaps", float(errors), 0.0),
             goal("responses from a version older than the newest at request time", float(len(older)), 0.0)]
    plot_name = "swaps_throughput.png"
    plot(rows, s["swap_times_s"], duration_s, ctx.out / plot_name)
    table = md_table(
        ["clients", "requests", "errors", "swaps", "req/s", "tokens/s", "TTFT p50 / p95 ms",
         "latency p50 / p95 / max ms", "older than newest"],
        [[clients, len(rows), errors, len(loads), s["throughput_rps"], s["tokens_per_s"],
          f"{ttft['p50']:.1f} / {ttft['p95']:.1f}", f"{lat['p50']:.1f} / {lat['p95']:.1f} / {lat['max']:.1f}",
          len(older)]])
    first_errors = sorted({r["error"] or str(r["status"]) for r in rows if not r["ok"]})[:3]
    if first_errors:
        table += "\n\nErrors seen: " + "; ".join(first_errors)
    return {"name": "swaps", "title": "3. Serving during swaps", "summary": s, "rows": rows, "goals": goals,
            "table": table, "plots": [plot_name]}


def plot(rows: list[dict[str, Any]], swaps: list[float], duration_s: float, path: Any) -> None:
    pyplot = plt()
    bins = max(1, int(duration_s))
    counts = [0] * (bins + 1)
    toks = [0] * (bins + 1)
    for r in rows:
        if r["ok"]:
            b = min(bins, int(r["end"]))
            counts[b] += 1
            toks[b] += r["tokens"]
    fig, ax = pyplot.subplots(figsize=(10, 3.5))
    ax.plot(range(bins + 1), toks, label="tokens/s", color="#4c72b0")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens per second")
    ax2 = ax.twinx()
    ax2.plot(range(bins + 1), counts, label="requests/s", color="#55a868", alpha=0.7)
    ax2.set_ylabel("requests per second")
    for i, t in enumerate(swaps):
        ax.axvline(t, color="#c44e52", alpha=0.5, linestyle="--", label="new version serving" if i == 0 else None)
    errs = [r["end"] for r in rows if not r["ok"]]
    if errs:
        ax.plot(errs, [0] * len(errs), "x", color="black", label="failed request")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Throughput while versions are swapped")
    save_figure(fig, path)


def replot(result: dict[str, Any], out: Path) -> None:
    rows, s = result["rows"], result["summary"]
    swaps = s.get("swap_times_s")
    if swaps is None:  # older results: the first request that started after each new version served
        swaps, seen = [], None
        for r in sorted(rows, key=lambda r: r["start"]):
            if seen is not None and r["newest_at_start"] != seen:
                swaps.append(r["start"])
            seen = r["newest_at_start"]
    plot(rows, swaps, s["duration_s"], out / "swaps_throughput.png")
