"""compose files: no service joins the host's IPC namespace (CIS Docker 5.16); GPU services size
their own /dev/shm instead, as the Kubernetes pods' in-memory volume does."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.compose_yaml import ComposeTags

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted(ROOT.glob("compose*.yaml")), ids=lambda p: p.name)
def test_no_service_shares_the_hosts_ipc_namespace(path: Path) -> None:
    services = yaml.load(path.read_text(), Loader=ComposeTags).get("services") or {}
    assert [name for name, s in services.items() if (s or {}).get("ipc") == "host"] == []


def test_the_gpu_services_have_a_dev_shm_of_their_own() -> None:
    services = yaml.load((ROOT / "compose.yaml").read_text(), Loader=ComposeTags)["services"]
    assert services["inference"]["shm_size"] == services["trainer"]["shm_size"] == "8gb"
