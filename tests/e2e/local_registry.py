"""A real container registry on loopback for the e2e tier: Debian's `docker-registry` package
(the Distribution registry, 2.8), run as a plain process with a config file of its own.

Storage is a throwaway directory, the listener 127.0.0.1 on a free port: docker treats
127.0.0.0/8 as an insecure registry by default, so pushes and pulls over plain http work with
no daemon configuration. `manifest` reads what the registry serves, over its HTTP API, so a test
can hold a digest against the registry itself rather than against docker's own bookkeeping.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from helpers.loopback import free_port, served_process

BINARY = "docker-registry"
MANIFEST_TYPES = ("application/vnd.docker.distribution.manifest.v2+json",
                  "application/vnd.oci.image.manifest.v1+json")


@dataclass(frozen=True)
class LocalRegistry:
    host: str
    """HOST:PORT, as image references name it."""

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def manifest(self, repository: str, reference: str) -> tuple[str, dict[str, Any]]:
        """(the digest the registry gives the manifest, the manifest) of repository:reference."""
        resp = httpx.get(f"{self.url}/v2/{repository}/manifests/{reference}",
                         headers={"Accept": ", ".join(MANIFEST_TYPES)}, timeout=10)
        resp.raise_for_status()
        return resp.headers["Docker-Content-Digest"], resp.json()

    def repositories(self) -> list[str]:
        resp = httpx.get(f"{self.url}/v2/_catalog", timeout=10)
        resp.raise_for_status()
        return list(resp.json().get("repositories") or [])


def available() -> bool:
    return shutil.which(BINARY) is not None


@contextmanager
def local_registry(workdir: Path) -> Iterator[LocalRegistry]:
    """The registry, serving from workdir/data on 127.0.0.1:<free port>, until the block ends."""
    port = free_port()
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    config = workdir / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {workdir / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    registry = LocalRegistry(f"127.0.0.1:{port}")
    with served_process([BINARY, "serve", str(config)], workdir / "registry.log", f"{registry.url}/v2/",
                        what=BINARY, timeout_s=30):
        yield registry
