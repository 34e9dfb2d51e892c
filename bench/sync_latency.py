"""Policy-sync latency: how fast a new version reaches the server.

Starts the local stack (tiny model, CPU by default), publishes N versions through real train
jobs, and measures for each version, from the event stream and a prober that keeps sending
one-token requests through the gateway:

    ready -> loaded   adapter_ready appended by the trainer  ->  adapter_loaded by the controller
    publish -> served  the version was registered              ->  first response served by it
    engine load        the engine's /load_lora_adapter time (load_ms in adapter_loaded)

Writes results.json, report.md and a latency histogram PNG under bench/results/<timestamp>/.

    python bench/sync_latency.py --versions 40
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import httpx

from tandem import Client, LoraConfig, OptimizerConfig
from tandem.cli import TINY_MODEL, ensure_tiny_model
from tandem.events import EventKind
from tandem.stack import Stack, StackConfig


class Prober(threading.Thread):
    """Sends one-token requests back to back and records when each version first answered."""

    def __init__(self, gateway_url: str, run: str) -> None:
        super().__init__(daemon=True)
        self.http = httpx.Client(base_url=gateway_url, timeout=30)
        self.run_name = run
        self.first_seen: dict[int, float] = {}
        self.requests = 0
        self.errors = 0
        self.stop_flag = threading.Event()

    def run(self) -> None:
        body = {"model": self.run_name, "prompt": "1", "max_tokens": 1}
        while not self.stop_flag.is_set():
            try:
                resp = self.http.post("/v1/completions", json=body)
                done = time.time()
                self.requests += 1
                if resp.status_code != 200:
                    self.errors += 1
                    continue
                version = int(resp.headers["x-tandem-version"])
                self.first_seen.setdefault(version, done)
            except httpx.HTTPError:
                self.errors += 1


def package_versions() -> dict[str, str]:
    out = {}
    for name in ("tandem", "torch", "transformers", "peft", "redis", "rq", "fastapi", "uvicorn"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": statistics.median(values), "p95": pct(values, 95), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--model", default=TINY_MODEL)
    parser.add_argument("--out", default=None, help="default: bench/results/<timestamp>")
    args = parser.parse_args()

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out or f"bench/results/{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    if args.model == TINY_MODEL:
        ensure_tiny_model(args.model)
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    print(f"starting the stack (logs in {out}/stack/logs) ...", flush=True)
    with Stack(StackConfig(state_dir=out / "stack", model=model, gateway_port=0)) as stack:
        client = Client(stack.gateway_url, stack.redis_url)
        run = client.create_run("bench", base_model=model, lora=LoraConfig(r=8, alpha=16), optimizer=OptimizerConfig(lr=1e-3))
        prober = Prober(stack.gateway_url, "bench")
        prober.start()
        for i in range(1, args.versions + 1):
            comps = run.chat([{"role": "user", "content": "Count."}], n=4, max_tokens=8)
            run.train([run.group(comps, [float(j) for j in range(4)])])
            print(f"\rversion {i}/{args.versions}", end="", flush=True)
        time.sleep(0.5)
        prober.stop_flag.set()
        prober.join(30)
        events = client.events.history(run="bench", count=10_000)
        client.close()
    print()

    ready = {e.version: e for e in events if e.kind is EventKind.ADAPTER_READY}
    loaded = {e.version: e for e in events if e.kind is EventKind.ADAPTER_LOADED}
    rows = []
    for v in sorted(ready):
        if v not in loaded:
            continue
        published = ready[v].data.get("published_at", ready[v].ts)
        rows.append({
            "version": v,
            "ready_to_loaded_ms": (loaded[v].ts - ready[v].ts) * 1000,
            "engine_load_ms": loaded[v].data.get("load_ms"),
            "publish_to_served_ms": (prober.first_seen[v] - published) * 1000 if v in prober.first_seen else None,
        })
    stages = {
        key: summary([r[key] for r in rows if r[key] is not None])
        for key in ("ready_to_loaded_ms", "engine_load_ms", "publish_to_served_ms")
    }
    meta = {
        "timestamp": stamp, "versions": len(rows), "model": model, "machine": platform.platform(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "packages": package_versions(),
        "probe_requests": prober.requests, "probe_errors": prober.errors,
        "versions_never_probed": [r["version"] for r in rows if r["publish_to_served_ms"] is None],
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "stages": stages, "rows": rows}, indent=1))
    lines = ["| stage | n | p50 ms | p95 ms | max ms |", "|---|---|---|---|---|"]
    for key, s in stages.items():
        lines.append(f"| {key} | {s['n']} | {s['p50']:.1f} | {s['p95']:.1f} | {s['max']:.1f} |")
    table = "\n".join(lines)
    (out / "report.md").write_text(f"# Policy sync latency ({stamp})\n\n{table}\n\n```\n{json.dumps(meta, indent=1)}\n```\n")
    plot(rows, out / "sync_latency.png")
    print(table)
    print(f"probe: {prober.requests} requests, {prober.errors} errors; results in {out}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, title in zip(axes, ["ready_to_loaded_ms", "publish_to_served_ms"],
                              ["adapter_ready -> adapter_loaded", "publish -> first response served"], strict=False):
        vals = [r[key] for r in rows if r[key] is not None]
        ax.hist(vals, bins=20)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("versions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
