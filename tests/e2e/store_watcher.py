"""Watch that no partial adapter version is ever visible (run inside the inference container).

    python -c "$(cat store_watcher.py)" STORE_ROOT GATEWAY_URL

Until its standard input closes it checks, over and over, the three places a version can be
seen, and verifies every version it finds there against its manifest
(`AdapterStore.verify`: every file's checksum, the adapter config):

    disk       every `v<N>` directory of every run in the store, as soon as it appears
    registry   every version Redis lists for a run (TANDEM_REDIS__URL)
    gateway    every version the gateway has loaded or routes to (`GET /v1/runs/<run>`)

Versions are immutable, so one that verified once is not checked again, and one that failed
is reported once for each place it was seen in. It also notes each
staging directory (`.tmp-*`) it sees, and when it was first and last seen. It prints `ready`
after its first full pass, and a JSON summary when its input closes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

import httpx

from tandem.adapters import AdapterStore
from tandem.errors import AdapterRejected
from tandem.registry import Registry
from tandem.settings import InferenceSettings

VERSION_DIR = re.compile(r"^v(\d{6})$")


class Watcher:
    def __init__(self, root: str, gateway_url: str) -> None:
        self.store = AdapterStore(root)
        self.registry = Registry(InferenceSettings().redis.connect())
        self.http = httpx.Client(base_url=gateway_url, timeout=5.0)
        self.verified: set[tuple[str, int]] = set()
        self.violations: list[dict[str, object]] = []
        """The first failed verification of each version in each place."""
        self.flagged: set[tuple[str, str, int]] = set()
        self.checks = {"disk": 0, "registry": 0, "gateway": 0}
        self.staging: dict[str, dict[str, float]] = {}
        self.errors = 0

    def check(self, where: str, run: str, version: int) -> None:
        self.checks[where] += 1
        if (run, version) in self.verified or (where, run, version) in self.flagged:
            return
        try:
            self.store.verify(run, version)
        except AdapterRejected as exc:
            self.flagged.add((where, run, version))
            self.violations.append({"where": where, "run": run, "version": version, "error": str(exc),
                                    "at": time.time()})
            return
        self.verified.add((run, version))

    def scan_disk(self) -> None:
        now = time.time()
        for run in os.listdir(self.store.root):
            try:
                names = os.listdir(self.store.root / run)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                m = VERSION_DIR.match(name)
                if m:
                    self.check("disk", run, int(m.group(1)))
                elif name.startswith(".tmp-"):
                    seen = self.staging.setdefault(f"{run}/{name}", {"first": now})
                    seen["last"] = now

    def scan_registry(self) -> list[str]:
        runs = self.registry.list_runs()
        for run in runs:
            for manifest in self.registry.manifests(run):
                self.check("registry", run, manifest.version)
        return runs

    def scan_gateway(self, runs: list[str]) -> None:
        for run in runs:
            resp = self.http.get(f"/v1/runs/{run}")
            if resp.status_code != 200:
                continue
            body = resp.json()
            for version in {*body["loaded_versions"], body["serving_version"]} - {0}:
                self.check("gateway", run, int(version))

    def pass_once(self, *, services: bool) -> None:
        self.scan_disk()
        if services:
            try:
                self.scan_gateway(self.scan_registry())
            except Exception:  # noqa: BLE001 - a service may be restarting; the disk scan goes on
                self.errors += 1


def main() -> int:
    watcher = Watcher(sys.argv[1], sys.argv[2])
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    watcher.pass_once(services=True)
    print("ready", flush=True)
    passes, last_services = 0, 0.0
    while not done.is_set():
        now = time.monotonic()
        services = now - last_services > 0.05
        watcher.pass_once(services=services)
        last_services = now if services else last_services
        passes += 1
        time.sleep(0.002)
    watcher.pass_once(services=True)
    print(json.dumps({"passes": passes, "checks": watcher.checks, "verified": len(watcher.verified),
                      "violations": watcher.violations, "staging_seen": watcher.staging,
                      "service_errors": watcher.errors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
