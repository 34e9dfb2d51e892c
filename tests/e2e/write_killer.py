"""SIGKILL the trainer while it writes one adapter version (run inside the trainer container).

    python -c "$(cat write_killer.py)" STORE_ROOT RUN VERSION POINT

It finds the trainer process (the child of the container's init, PID 1), prints `ready`,
then watches `<STORE_ROOT>/<RUN>/` until the staging directory of VERSION
(`.tmp-v<VERSION>-*`, see tandem.adapters) reaches POINT, and kills the trainer at once:

    staging    the staging directory exists (its files may not be written yet)
    weights    adapter/adapter_model.safetensors is in it (weights written or being written)
    manifest   manifest.json is in it (checksums done; fsync and rename to v<VERSION> pending)

When the version is renamed into place before POINT was seen, it kills at once all the same
(a kill after the write, which the caller tells apart). Killing the process, not the
container, is what an OOM kill does: the container exits with it and its restart policy
starts it again. Just before the signal it prints a JSON line: what it saw, and how long after
the staging directory appeared (the kill ends this script too, with the container).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

POINTS = {"staging": None, "weights": "adapter/adapter_model.safetensors", "manifest": "manifest.json"}
TIMEOUT_S = 120.0


def trainer_pid() -> int:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == 1:
                children.append(int(entry))
    if len(children) != 1:
        raise SystemExit(f"expected one child of the container's init, found {children}")
    return children[0]


def main() -> int:
    root, run, version, point = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    marker = POINTS[point]
    run_dir, prefix, final = os.path.join(root, run), f".tmp-v{version:06d}-", f"v{version:06d}"
    pid = trainer_pid()
    print("ready", flush=True)
    deadline = time.monotonic() + TIMEOUT_S
    staged_at: float | None = None
    seen = "nothing"
    while True:
        try:
            names = os.listdir(run_dir)
        except FileNotFoundError:
            names = []
        staged = [n for n in names if n.startswith(prefix)]
        if staged:
            staged_at = staged_at or time.monotonic()
            if marker is None or os.path.exists(os.path.join(run_dir, staged[0], marker)):
                seen = point
                break
        elif final in names:
            seen = "published"
            break
        if time.monotonic() > deadline:
            print(json.dumps({"killed": False, "seen": seen}), flush=True)
            return 1
        if staged_at is None:
            time.sleep(0.0005)  # before the write: poll gently; during it: spin
    after_ms = (time.monotonic() - staged_at) * 1000 if staged_at else None
    print(json.dumps({"killed": True, "pid": pid, "seen": seen, "ms_after_staging": after_ms}), flush=True)
    os.kill(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
