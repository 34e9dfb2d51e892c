"""A data-parallel trainer rank killed mid-job, for gpu_check's `--kill-rank`.

At one step gpu_check trains as usual while this module sends SIGKILL to one rank of the
trainer (found by the `RANK` torchrun gives each of its processes) part-way through the job,
and a prober keeps asking the gateway for completions the whole time. What it reports is what
a user of a multi-GPU trainer needs to hold: the job in flight failed and was retried (a
`train_failed` event for it, then its version), no version was published twice or torn (the
registry's versions are 1..N, each loaded, none rejected), the ranks came back (torchrun
started every rank again; the next steps train on all of them) and the engine kept serving
(the prober's failures).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from tandem.events import EventKind


def rank_pid(root: int, rank: int) -> int | None:
    """The pid of the process below `root` whose environment says RANK=`rank` (a torchrun worker)."""
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            environ = []
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b" ".join(environ):
            return pid
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        todo += [int(k) for k in kids]
    return None


class Prober(threading.Thread):
    """Asks the run for one short completion after another until stopped; counts answers and failures."""

    def __init__(self, run: Any) -> None:
        super().__init__(daemon=True)
        self.policy = run
        self.ok = 0
        self.failed: list[str] = []
        self.versions: set[int] = set()
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                comps = self.policy.chat([{"role": "user", "content": "Count for me."}], n=1, max_tokens=4)
                self.ok += 1
                self.versions.add(comps[0].version)
            except Exception as exc:  # noqa: BLE001 - every failure is what this counts
                self.failed.append(repr(exc)[:300])
                time.sleep(0.2)


def kill_during_train(trainer_pid: int, rank: int, run: Any, groups: Any,
                      train_s: list[float]) -> tuple[dict[str, Any], Any]:
    """Train `groups` while SIGKILL reaches `rank` at half the median train time so far: what
    happened, and the train result (None when train() failed)."""
    pid = rank_pid(trainer_pid, rank)
    delay_s = 0.5 * statistics.median(train_s) if train_s else 0.2
    result: dict[str, Any] = {}
    trained: list[Any] = []

    def train() -> None:
        t0 = time.monotonic()
        try:
            out = run.train(groups)
            trained.append(out)
            result.update(version=out.version, ranks=out.metrics.get("ranks"), train_s=out.train_s)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the check reads it
            result["error"] = repr(exc)[:500]
        result["wall_s"] = time.monotonic() - t0

    prober = Prober(run)
    prober.start()
    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    time.sleep(delay_s)
    killed = False
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
            killed = True
        except ProcessLookupError:
            pass
    worker.join(1800)
    time.sleep(2.0)  # a few probes on the new version too
    prober.stop_flag.set()
    prober.join(30)
    report = {"rank": rank, "pid": pid, "killed": killed, "delay_s": delay_s, "train": result,
              "probes_ok": prober.ok, "probes_failed": len(prober.failed), "probe_errors": prober.failed[:5],
              "probe_versions": sorted(prober.versions)}
    return report, (trained[0] if trained else None)


def verdict(kill: dict[str, Any], client: Any, run_name: str, trainer_log: str, ranks: int,
            rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the kill did, from the event stream, the registry and the trainer's log."""
    events = client.events.history(run=run_name, count=100_000)
    failed = [e for e in events if e.kind is EventKind.TRAIN_FAILED]
    rejected = [e for e in events if e.kind is EventKind.ADAPTER_REJECTED]
    loaded = sorted({e.version for e in events if e.kind is EventKind.ADAPTER_LOADED and e.version is not None})
    ready = [e.version for e in events if e.kind is EventKind.ADAPTER_READY]
    after = [r for r in rows if r["step"] > kill["step"]]
    starts = {r: trainer_log.count(f"parallel.start rank={r} world={ranks}") for r in range(ranks)}
    out = {
        **kill,
        "train_failed": [{"job": e.job_id, "message": str(e.data.get("message"))[:400],
                          "retries_left": e.data.get("retries_left")} for e in failed],
        "adapter_rejected": len(rejected),
        "versions_ready": ready, "versions_loaded": loaded,
        "rank_starts": starts,
        "ranks_after": sorted({r["ranks"] for r in after if r.get("ranks") is not None}),
    }
    expected = list(range(1, len(rows) + 1))
    out["checks"] = {
        "killed mid-job (a train_failed event for the job in flight)": bool(failed),
        "the job's version published once, in order (ready = 1..N)": ready == expected,
        "nothing rejected by inference": not rejected,
        "every version loaded": loaded == expected,
        "the ranks came back (every rank started twice)": all(n >= 2 for n in starts.values()),
        "later steps trained on every rank": out["ranks_after"] == [float(ranks)],
        "the engine kept serving (no probe failed)": kill["probes_failed"] == 0 and kill["probes_ok"] > 0,
    }
    return out
