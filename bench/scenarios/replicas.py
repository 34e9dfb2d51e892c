"""Scenario 8, replicas: one inference replica against two behind the router, on the local stack.

For each replica count the scenario starts its own stack (`tandem up --replicas N`: each replica
an inference service with its own engine; with two, HAProxy in front on the gateway port), then
  - throughput and latency: CLIENTS closed-loop clients send /v1/completions (distinct prompts,
    16 tokens) through the gateway for SECONDS;
  - publish -> served: VERSIONS versions trained one at a time; per version from `adapter_ready`
    to the `adapter_loaded` of the last replica (with two, a version serves only once both hold
    it: the wait for the slower one), and from the first replica's `adapter_loaded` to the last's.
CPU only: on GPUs each replica needs a GPU of its own.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.benchlib import Ctx, goal, md_table, new_version, plt, save_figure, summary
from tandem import Client, LoraConfig, OptimizerConfig
from tandem.dev.composition import StackConfig, haproxy_binary
from tandem.dev.stack import Stack
from tandem.errors import ConfigError
from tandem.events import EventKind

CLIENTS = 4


def counts(quick: bool) -> tuple[float, int]:
    """(seconds of load, versions) per replica count."""
    return (4.0, 3) if quick else (20.0, 10)


def load(url: str, seconds: float) -> dict[str, Any]:
    """CLIENTS closed-loop clients for `seconds`: requests per second, latency, replicas seen."""
    latencies: list[float] = []
    replicas: dict[str, int] = {}
    errors = 0
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        nonlocal errors
        with httpx.Client(base_url=url, timeout=120) as http:
            n = 0
            while time.monotonic() < stop:
                n += 1
                t0 = time.perf_counter()
                reply = http.post("/v1/completions", json={"model": "base", "prompt": f"{i}-{n}: count to ten",
                                                           "max_tokens": 16, "temperature": 1.0})
                elapsed = time.perf_counter() - t0
                with lock:
                    if reply.status_code != 200:
                        errors += 1
                        continue
                    latencies.append(elapsed)
                    replica = reply.headers.get("x-tandem-replica", "?")
                    replicas[replica] = replicas.get(replica, 0) + 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"requests": len(latencies), "errors": errors, "rps": len(latencies) / wall,
            "latency_s": summary(latencies), "replicas": replicas}


def publish_to_served(client: Client, ctx: Ctx, versions: int) -> list[dict[str, Any]]:
    run = client.create_run("replicas", base_model=ctx.model, lora=LoraConfig(r=8, alpha=16),
                            optimizer=OptimizerConfig(lr=1e-3))
    for i in range(versions):
        new_version(run)
        ctx.progress(f"  version {i + 1}/{versions}")
    events = run.history()
    rows = []
    for v in range(1, versions + 1):
        ready = next(e for e in events if e.kind == EventKind.ADAPTER_READY and e.version == v)
        announced = [e for e in events if e.kind == EventKind.ADAPTER_LOADED and e.version == v]
        loaded = sorted(e.ts for e in announced)
        rows.append({"version": v, "replicas_loaded": len({e.data.get("replica") for e in announced}),
                     "announcements": len(announced),
                     "ready_to_served_ms": (loaded[-1] - ready.ts) * 1000,
                     "first_to_last_ms": (loaded[-1] - loaded[0]) * 1000})
    return rows


def run(ctx: Ctx) -> dict[str, Any]:
    out = Path(ctx.out)
    if ctx.engine != "transformers":
        return {"name": "replicas", "title": "8. Replicas", "summary": {}, "goals": [], "plots": [],
                "table": "Not run: on GPUs each replica needs a GPU of its own (CPU stack only)."}
    try:
        haproxy_binary()
    except ConfigError as exc:
        return {"name": "replicas", "title": "8. Replicas", "summary": {}, "goals": [], "plots": [],
                "table": f"Not run: {exc}"}
    seconds, versions = counts(ctx.quick)
    results: dict[int, dict[str, Any]] = {}
    for n in (1, 2):
        ctx.progress(f"replicas: starting the stack with {n} replica(s)")
        state = out / f"stack-{n}"
        shutil.rmtree(state, ignore_errors=True)  # a fresh Redis: no run of an earlier try in its history
        config = StackConfig(state_dir=state, model=ctx.model, gateway_port=0, replicas=n)
        with Stack(config) as stack:
            ctx.progress(f"replicas: {n}: {CLIENTS} clients for {seconds:.0f} s")
            measured = load(stack.gateway_url, seconds)
            client = Client(stack.gateway_url, stack.redis_url)
            try:
                ctx.progress(f"replicas: {n}: {versions} versions")
                rows = publish_to_served(client, ctx, versions)
            finally:
                client.close()
        steady = rows[1:] if len(rows) > 1 else rows  # the first pays the engine's one-off wrap
        measured["ready_to_served_ms"] = summary([r["ready_to_served_ms"] for r in steady])
        measured["first_to_last_ms"] = summary([r["first_to_last_ms"] for r in steady])
        measured["all_replicas_loaded"] = all(r["replicas_loaded"] == n for r in rows)
        measured["rows"] = rows
        results[n] = measured
    one, two = results[1], results[2]
    table = md_table(
        ["replicas", "requests/s", "latency p50 s", "latency p95 s", "failed", "requests per replica",
         "ready → served p50 ms", "p95 ms", "first → last replica p50 ms"],
        [[n, r["rps"], r["latency_s"]["p50"], r["latency_s"]["p95"], r["errors"],
          ", ".join(f"{v}" for _, v in sorted(r["replicas"].items())),
          r["ready_to_served_ms"]["p50"], r["ready_to_served_ms"]["p95"], r["first_to_last_ms"]["p50"]]
         for n, r in results.items()])
    table += (f"\n\n{CLIENTS} closed-loop clients, {seconds:.0f} s per replica count; {versions} versions each "
              "(statistics leave out the first). With two replicas a version serves once both hold it.")
    goals = [
        goal("failed requests (1 and 2 replicas)", float(one["errors"] + two["errors"]), 0.0),
        goal("requests reach both replicas (replicas seen with 2)", float(len(two["replicas"])), 2.0, at_most=False),
        goal("every version loaded on every replica", float(one["all_replicas_loaded"] and two["all_replicas_loaded"]),
             1.0, at_most=False),
    ]
    plot_name = "replicas.png"
    plot(results, out / plot_name)
    summary_out = {str(n): {k: v for k, v in r.items() if k != "rows"} for n, r in results.items()}
    return {"name": "replicas", "title": "8. Replicas", "summary": summary_out, "goals": goals, "table": table,
            "plots": [plot_name], "rows": {str(n): r["rows"] for n, r in results.items()}}


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    pyplot = plt()
    fig, (left, right) = pyplot.subplots(1, 2, figsize=(10, 4))
    ns = sorted(results)
    left.bar([str(n) for n in ns], [results[n]["rps"] for n in ns], color="tab:blue")
    left.set_xlabel("replicas")
    left.set_ylabel("requests / s")
    left.set_title(f"throughput, {CLIENTS} clients")
    for n in ns:
        rows = results[n]["rows"]
        right.plot([r["version"] for r in rows], [r["ready_to_served_ms"] for r in rows], marker="o",
                   label=f"{n} replica(s)")
    right.set_xlabel("version")
    right.set_ylabel("adapter_ready -> served on every replica (ms)")
    right.set_title("publish -> served")
    right.legend()
    save_figure(fig, path, dpi=110)
