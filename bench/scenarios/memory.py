"""Scenario 11, engine memory across versions: does hot-loading one version after another leak?

Publishes N versions of the bench run through the stack's normal path (trainer job -> store ->
`adapter_ready` -> the controller loads it and unloads the ones past its keep-window) and, before
the first and after each one serves, samples the engine's memory:

- GPU engines: the GPU memory nvidia-smi lists for the engine's processes (the inference
  service's children: SGLang's scheduler, vLLM's engine core); when nvidia-smi lists none of
  those pids (a container's own pid namespace) the used memory of the inference GPUs instead,
  and the report says so;
- every engine: the resident set (RSS) of the engine's processes (psutil): host memory, where
  the transformers engine keeps everything and GPU engines keep their CPU copies of adapters.

The measured series is GPU memory on GPUs and RSS on the CPU. The report gives its value
before the first version, after the first (which pays one-off costs: the engine wraps the
model on its first adapter), the last and the max, the slope of a least-squares line over the
versions after the first (MiB per 10 versions) and the goal: growth from the first version to
the last at most 5 % (flat, not leaking).

    full: 100 versions; quick: 10
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import psutil

from bench.benchlib import Ctx, goal, gpu_memory, md_table, new_version, plt, save_figure

GROWTH_GOAL = 0.05


def engine_pids(ctx: Ctx) -> set[int]:
    """The engine's processes: the engine service's tree (CPU stack), else the inference service's
    children and theirs (a GPU engine runs under the inference service's launcher)."""
    assert ctx.stack is not None
    names = [s.name for s in ctx.stack.services]
    svc = ctx.stack.service("engine" if "engine" in names else "inference")
    if svc.proc is None:
        raise RuntimeError(f"the stack's {svc.name} service has no process")
    try:
        root = psutil.Process(svc.proc.pid)
        tree = root.children(recursive=True)
    except psutil.Error as exc:
        raise RuntimeError(f"cannot read the process tree of {svc.name} (pid {svc.proc.pid}): {exc}") from exc
    pids = {p.pid for p in tree}
    return pids | {root.pid} if svc.name == "engine" else pids


def rss_mib(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:  # a process that ended between listing and reading
            continue
    return total / 2**20


def gpu_mib(pids: set[int], gpus: list[int]) -> tuple[float, str] | None:
    """(MiB, where from): the engine's processes as nvidia-smi lists them, else its GPUs' used memory."""
    now = gpu_memory()
    if now is None:
        return None
    mine = [m for p, m in now["pid_mib"].items() if p in pids]
    if mine:
        return sum(mine), "engine processes"
    return sum(now["gpu_mib"].get(g, 0.0) for g in gpus), "inference GPUs (nvidia-smi listed none of the engine's pids)"


def slope_per_10(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, times 10 (MiB per 10 versions); 0 with fewer than 2 points."""
    if len(set(xs)) < 2:
        return 0.0
    return 10 * statistics.linear_regression(xs, ys).slope


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None and ctx.client is not None
    count = 10 if ctx.quick else 100
    on_gpu = ctx.engine != "transformers"
    gpus = json.loads(ctx.engine_env.get("TANDEM_GPUS__INFERENCE", "[0]"))
    run = ctx.client.run(ctx.run_name)
    sources: set[str] = set()

    def sample(version: int, i: int) -> dict[str, Any]:
        pids = engine_pids(ctx)
        row: dict[str, Any] = {"i": i, "version": version, "pids": len(pids), "rss_mib": rss_mib(pids)}
        gpu = gpu_mib(pids, gpus) if on_gpu else None
        if gpu is not None:
            row["gpu_mib"] = gpu[0]
            sources.add(gpu[1])
        return row

    rows = [sample(ctx.client.registry.serving(run.name), 0)]
    for i in range(1, count + 1):
        rows.append(sample(new_version(run), i))
        if i % 10 == 0 or i == count:
            ctx.progress(f"{i}/{count} versions: RSS {rows[-1]['rss_mib']:.0f} MiB"
                         + (f", GPU {rows[-1]['gpu_mib']:.0f} MiB" if "gpu_mib" in rows[-1] else ""))
    key = "gpu_mib" if all("gpu_mib" in r for r in rows) else "rss_mib"
    series = {k: stats(rows, k) for k in ("gpu_mib", "rss_mib") if all(k in r for r in rows)}
    s = series[key]
    what = "GPU memory" if key == "gpu_mib" else "RSS"
    goals = [goal(f"engine {what} growth from the first version to the last (share)", s["growth"], GROWTH_GOAL,
                  note=f"{s['first']:.0f} -> {s['last']:.0f} MiB over {count} versions, "
                       f"{s['slope_mib_per_10']:+.1f} MiB per 10 versions")]
    plot_name = "memory.png"
    plot(rows, ctx.out / plot_name)
    table = md_table(["memory", "before MiB", "first version MiB", "last MiB", "max MiB", "growth", "MiB per 10 versions"],
                     [[("GPU" if k == "gpu_mib" else "RSS") + (" (measured)" if k == key else ""), v["before"],
                       v["first"], v["last"], v["max"], f"{100 * v['growth']:+.1f} %", v["slope_mib_per_10"]]
                      for k, v in series.items()])
    table += (f"\n\n{count} versions of run {run.name}, v{rows[1]['version']} to v{rows[-1]['version']}; the engine's "
              f"{rows[-1]['pids']} process(es)" + (f"; GPU memory from {', '.join(sorted(sources))}" if sources else "")
              + ".")
    return {"name": "memory", "title": "11. Engine memory across versions",
            "summary": {"versions": count, "measured": key, "gpu_source": sorted(sources), **series},
            "rows": rows, "goals": goals, "table": table, "plots": [plot_name]}


def stats(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Before, first version, last, max, growth first -> last, and the slope after the first version."""
    after = rows[1:]
    first, last = after[0][key], after[-1][key]
    return {"before": rows[0][key], "first": first, "last": last, "max": max(r[key] for r in rows),
            "growth": (last - first) / first if first else 0.0,
            "slope_mib_per_10": slope_per_10([float(r["i"]) for r in after], [r[key] for r in after])}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(8, 3.5))
    xs = [r["i"] for r in rows]
    ax.plot(xs, [r["rss_mib"] for r in rows], "o-", ms=3, color="#4c72b0", label="engine RSS")
    ax.set_xlabel("versions published")
    ax.set_ylabel("RSS, MiB")
    if all("gpu_mib" in r for r in rows):
        gpu_ax = ax.twinx()
        gpu_ax.plot(xs, [r["gpu_mib"] for r in rows], "s-", ms=3, color="#c44e52", label="engine GPU memory")
        gpu_ax.set_ylabel("GPU memory, MiB")
        gpu_ax.legend(loc="lower right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Engine memory across versions")
    save_figure(fig, path)


def replot(result: dict[str, Any], out: Path) -> None:
    plot(result["rows"], out / "memory.png")
