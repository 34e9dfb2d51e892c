"""SGLang stays on its container's loopback. SGLang 0.5.12 serves an unauthenticated route that
unpickles its request body (`/load_lora_adapter_from_tensors`, CVE-2026-15969): whoever reaches
its port runs code in the inference container. The launcher binds SGLang to the host of
TANDEM_ENGINE__URL; by default, in the GPU image and in compose.yaml that is 127.0.0.1, and
neither the image nor compose publishes the engine's port."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from tandem.settings import EngineSettings, GpuSettings, InferenceSettings
from tandem_inference.engines.sglang_launcher import sglang_argv

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def test_the_launcher_binds_sglang_to_loopback_by_default() -> None:
    engine = EngineSettings(kind="sglang", model="/models/m")
    argv = sglang_argv(InferenceSettings(engine=engine, gpus=GpuSettings(mode="split", inference=[0], trainer=[1])))
    host = argv[argv.index("--host") + 1]
    assert loopback(host), f"SGLang would listen on {host}"


def test_the_gpu_stack_keeps_the_engine_on_loopback_and_unpublished() -> None:
    inference = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["inference"]
    assert loopback(urlparse(inference["environment"]["TANDEM_ENGINE__URL"]).hostname or "")
    published = [str(p).rsplit(":", 1)[-1] for p in inference.get("ports", [])]
    assert published == ["8000"], f"only the gateway may be published, not {published}"


def test_the_gpu_image_neither_moves_nor_exposes_the_engine() -> None:
    dockerfile = (ROOT / "images" / "inference.Dockerfile").read_text()
    assert "TANDEM_ENGINE__URL" not in dockerfile and "TANDEM_ENGINE__HOST" not in dockerfile
    exposed = [line.split()[1:] for line in dockerfile.splitlines() if line.startswith("EXPOSE")]
    assert exposed == [["8000"]]
