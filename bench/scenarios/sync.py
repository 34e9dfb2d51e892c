"""Scenario 1, policy-sync latency: from the trainer's optimizer step to the first response
served by the new version, stage by stage, over 30+ versions, beside the floor.

Stages per version, from the event stream (`adapter_ready` carries `stepped_at`,
`published_at` and the publish's stages; `adapter_loaded` carries the engine's `load_ms` and
the controller's stages) and from probers that keep sending one-token requests through the
gateway. The trainer reads its clocks after synchronising CUDA:

    step -> written    optimizer step done on the device -> version renamed into the store
      stage            the adapter into host memory: finding its tensors, then `copy` (inside)
      copy             device -> host buffers, in the adapter's dtype (inside `stage`)
      prepare          the rest before the first byte is written: the step's statistics, the
                       manifest, clearing stale staging directories (inside step -> written)
      write            the files written from those buffers, with their checksums (inside)
        hash           the weights' checksum, from the buffers, in a thread beside `weights`
                       (inside `write`)
        weights        their file opened (or a blank linked), written and closed (inside `write`)
        config         adapter_config.json written and hashed, in a thread beside `weights`
                       (inside `write`; the rest of `write` is the wait for those threads, the
                       blank taken and the header's view made)
      rename           manifest + rename into place (inside; the fsync comes after the announcement)
    written -> ready   -> registered and `adapter_ready` appended
    ready -> loaded    -> the controller checked it, the engine loaded it while the checksums
                          were verified, the alias switched
      read             `adapter_ready` -> the controller begins the load: the event through Redis,
                       its read, the wait for the controller's lock and for events before it in
                       the page (inside; the trainer's clock against the controller's)
      check            the controller's checks of the files before the load (inside)
        check_work     the checks themselves (inside `check`; the rest, where they run in a
                       thread, is the hand-off to it and back to the event loop)
      attempt          the load attempt's number, from Redis, counted beside the checks: its
                       wait past them (inside)
      room             making room in the engine (inside): judged by the controller's ledger of
                       the engine's adapters; where that is unknown, the engine's list is asked
                       for beside the checks, and this is the wait past them; any unloads if it
                       is full
        look           that list, when asked, from the call's start to its answer read (beside
                       `check` and `attempt`, and `room` past them)
      verify           the checksums, beside the engine's load (inside)
      agree            the version loaded and checked -> the alias switched: the replicas'
                       agreement, read from Redis (with no other replica, one read) (inside)
    loaded -> served   -> a response by the new version came back
    step -> served     the whole path

tandem's own overhead is step -> served minus the engine's load and the first forward (the
duration of the request that first came back from the new version; a prober starts sending
requests when `adapter_ready` appears and stops when the new version answers). The probe's wait,
loaded -> served minus the first forward (0 when that request started before `adapter_loaded`
was appended, after the switch), is shown beside it: the prober's request in flight at the
switch went to the old version, so the first the new version answers may start later. So is
`overhead_to_loaded`, step -> `adapter_loaded` minus the engine's load: the overhead without
the probe's wait (a request sent when `adapter_ready` appeared that reaches the engine after
the load began waits behind it, and answers from the old version after the switch).

What a new request sees is measured apart: a second prober sends one request when it reads a
version's `adapter_loaded` (`sent`: that event's `ts` -> the request sent), and `step -> fresh`
is the optimizer step -> its response; a response from an older version there would be a
routing error and is counted. The floor is what the same bytes cost without tandem: write the
adapter file (fsync), read it back, and copy its tensors to the engine's device.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.benchlib import Ctx, bench_run, goal, new_version, plt, save_figure, stage_table, summary
from tandem import Client
from tandem.events import EventKind


class Prober:
    """Follows the event stream; on each `adapter_ready` of the run it sends one-token requests
    back to back until the new version answers, and remembers that first response (its end
    and its duration). Idle otherwise, so it does not load the machine while the trainer
    writes the next version. A version not served within `horizon_s` of its `adapter_ready` is given up.
    With `fresh`, a second thread also sends one request as it reads each version's first
    `adapter_loaded`: what a request sent after the switch sees."""

    def __init__(self, gateway_url: str, client: Client, run: str, horizon_s: float = 60.0, *,
                 fresh: bool = False) -> None:
        self.url, self.client, self.run_name, self.horizon_s = gateway_url, client, run, horizon_s
        self.first: dict[int, tuple[float, float]] = {}  # version -> (end, duration)
        self.answered: dict[int, int] = {}  # version -> the version that answered (newer where it was skipped)
        self.requests = self.errors = 0
        self.fresh: dict[int, tuple[float, float, float, int]] = {}  # version -> (sent, end, duration, answered by)
        self.fresh_errors = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._follow, args=(EventKind.ADAPTER_READY, self._until_served),
                                         daemon=True)]
        if fresh:  # and one request as each version's `adapter_loaded` is read
            self.threads.append(threading.Thread(target=self._follow, args=(EventKind.ADAPTER_LOADED, self._at_switch),
                                                 daemon=True))
        self.start_id = client.events.last_id()

    def __enter__(self) -> Prober:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)  # past a request's timeout (60 s)

    def _follow(self, kind: EventKind, handle: Callable[[httpx.Client, int], None]) -> None:
        """Read the stream from where the prober began; `handle` each of the run's `kind` events' version."""
        after = self.start_id
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.stop.is_set():
                page = self.client.events.read(after, block_ms=200)
                after = page.last_id
                for event in page:
                    if event.kind is kind and event.run == self.run_name and event.version:
                        handle(http, event.version)

    def _at_switch(self, http: httpx.Client, version: int) -> None:
        """One request as the version's first `adapter_loaded` is read: what a request sent after
        the switch sees."""
        if version in self.fresh:
            return
        if (answer := self._post(http)) is None:
            self.fresh_errors += 1
            return
        sent, end, served = answer
        self.fresh[version] = (sent, end, end - sent, served)

    def _until_served(self, http: httpx.Client, version: int) -> None:
        deadline = time.time() + self.horizon_s
        while time.time() < deadline and not self.stop.is_set():
            self.requests += 1
            if (answer := self._post(http)) is None:
                self.errors += 1
                continue
            start, end, served = answer
            if served >= version:
                self.first[version] = (end, end - start)
                self.answered[version] = served
                return

    def _post(self, http: httpx.Client) -> tuple[float, float, int] | None:
        """One one-token request: when it was sent, when it came back, the version that answered;
        None where it failed."""
        start = time.time()
        try:
            resp = http.post("/v1/completions", json={"model": self.run_name, "prompt": "1", "max_tokens": 1})
        except httpx.HTTPError:
            return None
        if resp.status_code != 200 or not resp.headers.get("x-tandem-version", "").isdigit():
            return None
        return start, time.time(), int(resp.headers["x-tandem-version"])


def floor_ms(adapter_dir: Path, device: str) -> float:
    """Write the adapter's bytes (fsync), read them back, copy the tensors to `device`."""
    import torch
    from safetensors.torch import load

    data = (adapter_dir / "adapter_model.safetensors").read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "adapter_model.safetensors"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tensors = load(path.read_bytes())
        on_device = [t.to(device) for t in tensors.values()]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - t0) * 1000
    del on_device
    return elapsed


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None and ctx.client is not None
    versions = 8 if ctx.quick else 40
    run = bench_run(ctx)
    # the versions this call publishes: a state directory of an earlier call holds that call's too
    mine: list[int] = []
    with Prober(ctx.stack.gateway_url, ctx.client, run.name, fresh=True) as probers:
        for i in range(1, versions + 1):
            mine.append(new_version(run))
            ctx.progress(f"version {i}/{versions}")
        time.sleep(0.5)
    events = ctx.client.events.history(run=run.name, count=100_000)
    ready = {e.version: e for e in events if e.kind is EventKind.ADAPTER_READY}
    loaded: dict[int | None, Any] = {}
    for e in events:  # a version's first announcement: when it began to serve (a later one repeats it)
        if e.kind is EventKind.ADAPTER_LOADED:
            loaded.setdefault(e.version, e)
    store = ctx.store_root
    rows = []
    for v in mine:
        if v not in ready or v not in loaded:
            continue
        r, ld = ready[v], loaded[v]
        stepped = r.data.get("stepped_at")
        published = r.data.get("published_at", r.ts)
        first = probers.first.get(v)
        row: dict[str, Any] = {
            "version": v,
            "step_to_written_ms": (published - stepped) * 1000 if stepped else None,
            "written_to_ready_ms": (r.ts - published) * 1000,
            "ready_to_loaded_ms": (ld.ts - r.ts) * 1000,
            "engine_load_ms": ld.data.get("load_ms"),
            "loaded_to_served_ms": (first[0] - ld.ts) * 1000 if first else None,
            "first_forward_ms": first[1] * 1000 if first else None,
            "publish_to_served_ms": (first[0] - published) * 1000 if first else None,
            "step_to_served_ms": (first[0] - stepped) * 1000 if first and stepped else None,
        }
        published_stages, loaded_stages = r.data.get("stages_ms") or {}, ld.data.get("stages_ms") or {}
        for key in ("stage", "copy", "prepare", "write", "hash", "weights", "config", "rename"):
            row[f"{key}_ms"] = published_stages.get(key)
        for key in ("read", "check", "check_work", "attempt", "room", "look", "verify", "agree"):
            row[f"{key}_ms"] = loaded_stages.get(key)
        if row["step_to_served_ms"] is not None:
            row["probe_wait_ms"] = max(0.0, row["loaded_to_served_ms"] - row["first_forward_ms"])
            row["overhead_ms"] = row["step_to_served_ms"] - (row["engine_load_ms"] or 0) - row["first_forward_ms"]
        else:
            row["probe_wait_ms"] = row["overhead_ms"] = None
        if stepped:
            row["overhead_to_loaded_ms"] = (ld.ts - stepped) * 1000 - (row["engine_load_ms"] or 0)
        if (fresh := probers.fresh.get(v)) is not None:
            sent, end, duration, answered = fresh
            row["fresh_sent_ms"] = (sent - ld.ts) * 1000
            row["fresh_forward_ms"] = duration * 1000
            row["fresh_answered"] = answered
            row["step_to_fresh_ms"] = (end - stepped) * 1000 if stepped else None
        adapter = store / run.name / f"v{v:06d}" / "adapter"
        row["floor_ms"] = floor_ms(adapter, ctx.device) if adapter.is_dir() else None
        row["adapter_bytes"] = sum(p.stat().st_size for p in adapter.glob("*")) if adapter.is_dir() else None
        rows.append(row)
    # the first version pays one-off costs (the engine wraps the base model on its first load)
    steady = rows[1:] if len(rows) > 2 else rows
    keys = ["step_to_written_ms", "stage_ms", "copy_ms", "prepare_ms", "write_ms", "hash_ms", "weights_ms", "config_ms",
            "rename_ms", "written_to_ready_ms",
            "ready_to_loaded_ms", "read_ms", "check_ms", "check_work_ms", "attempt_ms", "room_ms", "look_ms", "engine_load_ms",
            "verify_ms",
            "agree_ms",
            "loaded_to_served_ms", "probe_wait_ms", "first_forward_ms",
            "step_to_served_ms", "publish_to_served_ms", "overhead_ms", "overhead_to_loaded_ms",
            "fresh_sent_ms", "fresh_forward_ms", "step_to_fresh_ms", "floor_ms"]
    stages = {k: summary([r[k] for r in steady if r.get(k) is not None]) for k in keys
              if any(r.get(k) is not None for r in steady)}
    stale = sum(1 for r in rows if r.get("fresh_answered") is not None and r["fresh_answered"] < r["version"])
    unasked = sum(1 for r in rows if r.get("fresh_answered") is None)
    overhead = stages["overhead_ms"]["p50"]
    served = stages["publish_to_served_ms"]["p50"]
    floor = stages["floor_ms"]["p50"]
    on_gpu = ctx.device.startswith("cuda")
    goals = [
        goal("tandem's own overhead in the sync path, p50 ms", overhead, 30.0 if on_gpu else 20.0,
             note="step -> served minus the engine's load and the first forward"),
        goal("publish -> served p50 within 3x the floor (ratio)", served / floor if floor else float("inf"), 3.0,
             note=f"publish -> served {served:.1f} ms, floor {floor:.2f} ms"),
        goal("failed probe requests", float(probers.errors + probers.fresh_errors), 0.0),
        goal("requests sent after the switch answered by an older version", float(stale), 0.0),
        goal("versions with no answer to a request sent after the switch", float(unasked), 0.0),
    ]
    if ctx.shape == "8b":
        step_to_served = stages["step_to_served_ms"]
        goals += [goal("optimizer step -> first response by the new version, p50 ms", step_to_served["p50"], 500.0),
                  goal("optimizer step -> first response by the new version, p95 ms", step_to_served["p95"], 800.0)]
    plot_name = "sync_latency.png"
    plot(rows, ctx.out / plot_name)
    table = stage_table(stages)
    table += (f"\n\n{len(rows)} versions (statistics leave out the first, which pays the engine's one-off "
              f"wrap of the base model); {probers.requests} probe requests, "
              f"{probers.errors} failed; {len(probers.fresh)} sent after a switch ({probers.fresh_errors} failed), "
              f"{stale} of them answered by an older version; adapter {rows[-1]['adapter_bytes'] if rows else 0} bytes.")
    return {
        "name": "sync", "title": "1. Policy sync latency", "summary": {k: v for k, v in stages.items()},
        "rows": rows, "goals": goals, "table": table, "plots": [plot_name],
        "probe_requests": probers.requests, "probe_errors": probers.errors + probers.fresh_errors,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    pyplot = plt()
    keys = [("step_to_written_ms", "step -> written"), ("written_to_ready_ms", "written -> adapter_ready"),
            ("ready_to_loaded_ms", "adapter_ready -> loaded"), ("engine_load_ms", "engine load (inside)"),
            ("loaded_to_served_ms", "loaded -> first response"), ("step_to_served_ms", "step -> served (total)"),
            ("overhead_ms", "tandem overhead"), ("floor_ms", "floor: write+read+copy")]
    fig, axes = pyplot.subplots(2, 4, figsize=(15, 6))
    for ax, (key, title) in zip(axes.flat, keys, strict=True):
        vals = [r[key] for r in rows[1:] if r[key] is not None]
        ax.hist(vals, bins=20, color="#4c72b0")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ms")
    axes[0][0].set_ylabel("versions")
    axes[1][0].set_ylabel("versions")
    fig.suptitle("Policy sync latency per stage")
    save_figure(fig, path)


def replot(result: dict[str, Any], out: Path) -> None:
    plot(result["rows"], out / "sync_latency.png")
