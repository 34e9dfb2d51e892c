"""Scenario 10, rollout throughput: closed-loop clients through the gateway, at several
concurrencies, against several resident adapters.

Each adapter is the newest version of a run of its own (`tp-01`, `tp-02`, ...), trained and
published through the stack's normal path (trainer job -> store -> `adapter_ready` -> the
controller loads it), so every adapter of a cell is resident in the engine at once. For each
cell of the grid (concurrency x resident adapters) that many clients send completions back to
back for a fixed time, the requests spread round-robin over the cell's adapters; the cell
reports requests/s, generated tokens/s (the responses' `usage`), latency p50/p95, requests
refused with 429 and failed ones. Requests still in flight when the time is up finish and count;
a cell's rates are over its wall time.

    full:  concurrency {1, 8, 64} x adapters {1, 4, 16}, 10 s a cell
    quick: concurrency {1, 8} x adapters {1, 4}, 2 s a cell
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.benchlib import Ctx, Sample, closed_loop, goal, md_table, new_version, plt, save_figure, summary
from tandem import LoraConfig, OptimizerConfig
from tandem.dev.toy import PROMPTS


def grid(quick: bool) -> tuple[list[int], list[int], float]:
    """(concurrencies, adapter counts, seconds per cell)."""
    return ([1, 8], [1, 4], 2.0) if quick else ([1, 8, 64], [1, 4, 16], 10.0)


def run_names(count: int) -> list[str]:
    return [f"tp-{i:02d}" for i in range(1, count + 1)]


def publish_adapters(ctx: Ctx, count: int) -> dict[str, int]:
    """One published, serving version for each of `count` runs: run name -> version."""
    assert ctx.client is not None
    rank = 8 if ctx.engine == "transformers" else 16
    versions = {}
    for name in run_names(count):
        run = ctx.client.create_run(name, base_model=ctx.model, lora=LoraConfig(r=rank, alpha=2 * rank),
                                    optimizer=OptimizerConfig(lr=1e-3))
        existing = ctx.client.registry.serving(name)
        versions[name] = existing if existing else new_version(run)
        ctx.progress(f"adapter {name} v{versions[name]} serving")
    return versions


def request(models: list[str], max_tokens: int, turn: Iterator[int]) -> Callable[[httpx.Client, int], Sample]:
    """A closed-loop client's request: the next of `models` round-robin, one completion, its tokens counted;
    a refused one (429) waits the Retry-After it was given before the client sends again."""
    def send(http: httpx.Client, i: int) -> Sample:
        k = next(turn)
        model = models[k % len(models)]
        body = {"model": model, "prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 1.0}
        t0 = time.time()
        try:
            resp = http.post("/v1/completions", json=body, timeout=300)
            ok = resp.status_code == 200
            tokens = int(resp.json()["usage"]["completion_tokens"]) if ok else 0
            sample = Sample(client=i, start=t0, end=time.time(), ttft=None, ok=ok, status=resp.status_code,
                            error="" if ok else resp.text[:200], tokens=tokens, model=model)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            return Sample(client=i, start=t0, end=time.time(), ttft=None, ok=False,
                          error=f"{type(exc).__name__}: {exc}"[:200], model=model)
        if resp.status_code == 429:
            time.sleep(float(resp.headers.get("retry-after", "1")))
        return sample
    return send


def cell(url: str, models: list[str], concurrency: int, duration_s: float, max_tokens: int) -> dict[str, Any]:
    """One cell: `concurrency` clients for `duration_s`, requests spread round-robin over `models`."""
    start = time.time()
    samples = closed_loop(request(models, max_tokens, itertools.count()), clients=concurrency,
                          duration_s=duration_s, base_url=url)
    wall = time.time() - start
    ok = [s for s in samples if s.ok]
    refused = sum(s.status == 429 for s in samples)
    lat = summary([(s.end - s.start) * 1000 for s in ok])
    return {"concurrency": concurrency, "adapters": len(models), "wall_s": round(wall, 3), "requests": len(samples),
            "ok": len(ok), "refused": refused, "errors": len(samples) - len(ok) - refused,
            "requests_per_s": len(ok) / wall, "tokens_per_s": sum(s.tokens for s in ok) / wall,
            "latency_ms_p50": lat["p50"], "latency_ms_p95": lat["p95"],
            "per_adapter": {m: sum(s.model == m for s in ok) for m in models},
            "first_errors": sorted({s.error for s in samples if not s.ok and s.status != 429})[:3]}


def warm_up(url: str, models: list[str], max_tokens: int) -> None:
    """One request on each adapter, all at once: first-use costs stay out of the cells."""
    samples = closed_loop(request(models, max_tokens, itertools.count()), clients=len(models),
                          requests_per_client=1, base_url=url)
    failed = [f"{s.model}: {s.status} {s.error}" for s in samples if not s.ok]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed}")


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None and ctx.client is not None
    concurrencies, counts, duration_s = grid(ctx.quick)
    max_tokens = 16 if ctx.engine == "transformers" else 128
    versions = publish_adapters(ctx, max(counts))
    names = list(versions)
    url = ctx.stack.gateway_url
    ctx.progress(f"warm-up: one request on each of {len(names)} adapters")
    warm_up(url, names, max_tokens)
    rows = []
    for adapters in counts:
        for concurrency in concurrencies:
            row = cell(url, names[:adapters], concurrency, duration_s, max_tokens)
            rows.append(row)
            ctx.progress(f"{concurrency:>3} clients x {adapters:>2} adapters: {row['requests_per_s']:.1f} req/s, "
                         f"{row['tokens_per_s']:.0f} tokens/s, p50 {row['latency_ms_p50']:.0f} ms, "
                         f"{row['errors']} failed, {row['refused']} refused")
    errors = sum(r["errors"] for r in rows)
    plot_name = "throughput.png"
    plot(rows, ctx.out / plot_name)
    table = md_table(
        ["clients", "adapters", "requests", "req/s", "tokens/s", "latency p50 / p95 ms", "refused (429)", "failed"],
        [[r["concurrency"], r["adapters"], r["requests"], r["requests_per_s"], r["tokens_per_s"],
          f"{r['latency_ms_p50']:.0f} / {r['latency_ms_p95']:.0f}", r["refused"], r["errors"]] for r in rows])
    table += (f"\n\n{duration_s:g} s a cell, max_tokens {max_tokens}, temperature 1.0; each adapter the newest version "
              f"of its own run ({', '.join(f'{n} v{v}' for n, v in versions.items())}).")
    seen = sorted({e for r in rows for e in r["first_errors"]})[:3]
    if seen:
        table += "\n\nErrors seen: " + "; ".join(seen)
    return {"name": "throughput", "title": "10. Rollout throughput by concurrency and resident adapters",
            "summary": {"max_tokens": max_tokens, "cell_s": duration_s, "adapters": versions, "grid": rows},
            "rows": rows, "goals": [goal("failed requests across the throughput grid", float(errors), 0.0)],
            "table": table, "plots": [plot_name]}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    pyplot = plt()
    concurrencies = sorted({r["concurrency"] for r in rows})
    counts = sorted({r["adapters"] for r in rows})
    width = 0.8 / len(counts)
    fig, ax = pyplot.subplots(figsize=(8, 4))
    for j, adapters in enumerate(counts):
        by_c = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["adapters"] == adapters}
        xs = [i + (j - (len(counts) - 1) / 2) * width for i in range(len(concurrencies))]
        ax.bar(xs, [by_c.get(c, 0.0) for c in concurrencies], width, label=f"{adapters} adapter(s)")
    ax.set_xticks(range(len(concurrencies)), [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("generated tokens per second")
    ax.set_title("Rollout throughput through the gateway")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def replot(result: dict[str, Any], out: Path) -> None:
    plot(result["rows"], out / "throughput.png")
