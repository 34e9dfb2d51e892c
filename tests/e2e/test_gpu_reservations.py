"""The GPU stack's device reservations, as Docker creates them: `docker compose create` for split,
shared and cpu, then `docker inspect` of each container's HostConfig.DeviceRequests (driver,
device ids, capabilities).

No GPU is needed: Docker records device requests when it creates a container and asks the
NVIDIA toolkit for the devices only when it starts one. No GPU image is needed either: an extra
compose file points every service at an empty local image (`docker import` of an empty tar),
because only the reservations of compose.yaml and compose.cpu.yaml are under test. The modes
are what `make up` passes to compose (GPU_MODE, INFERENCE_GPU, TRAINER_GPU; see the Makefile).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from compose_stack import ROOT, docker_answers

pytestmark = pytest.mark.e2e

IMAGE = "tandem-e2e-empty:latest"
GPU = {"Driver": "nvidia", "Capabilities": [["gpu"]], "Count": 0}
# create(compose files, environment, extra compose files) -> {service: its HostConfig.DeviceRequests}
Create = Callable[..., dict[str, object]]


def compose_v2() -> tuple[int, ...] | None:
    done = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True, timeout=30)
    m = re.match(r"v?(\d+)\.(\d+)", done.stdout.strip()) if done.returncode == 0 else None
    return (int(m[1]), int(m[2])) if m else None


@pytest.fixture(scope="module")
def empty_image() -> str:
    if not docker_answers():
        pytest.skip("no docker engine answers (images/install-docker.sh installs and starts one)")
    version = compose_v2()
    if version is None or version < (2, 24):
        pytest.skip(f"Docker Compose v2.24 or newer is needed (found {version}); images/install-compose-v2.sh installs it")
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=30).returncode != 0:
        tar = subprocess.run(["tar", "cf", "-", "-T", "/dev/null"], capture_output=True, check=True, timeout=30).stdout
        subprocess.run(["docker", "import", "-", IMAGE], input=tar, capture_output=True, check=True, timeout=60)
    return IMAGE


@pytest.fixture
def created(empty_image: str, tmp_path: Path) -> Iterator[Create]:
    """Creates (never starts) a fresh compose project per call; all are taken down afterwards."""
    # .env.example with every required secret (an empty `NAME=` line) set, as `make .env` does.
    env_file = tmp_path / ".env"
    example = (ROOT / ".env.example").read_text()
    env_file.write_text(re.sub(r"^([A-Z_]+)=$", lambda m: f"{m[1]}={secrets.token_hex(16)}", example, flags=re.M))
    projects: list[list[str]] = []

    def create(files: list[str], env: dict[str, str], extra: Sequence[Path] = ()) -> dict[str, object]:
        project = f"tandem-devreq-{os.getpid()}-{len(projects)}"
        services = ["redis", "inference", "trainer"] + (["engine", "model"] if "compose.cpu.yaml" in files else [])
        images = tmp_path / f"{project}.images.yaml"
        images.write_text("services:\n" + "".join(f"  {s}: {{image: \"{empty_image}\"}}\n" for s in services))
        args = ["docker", "compose", "-p", project, "--env-file", str(env_file)]
        for f in [*(str(ROOT / f) for f in files), str(images), *(str(p) for p in extra)]:
            args += ["-f", f]
        projects.append(args)
        run_env = {k: v for k, v in os.environ.items() if k not in ("GPU_MODE", "INFERENCE_GPU", "TRAINER_GPU")}
        done = subprocess.run([*args, "create", "--no-build", "--pull", "never"], cwd=ROOT, env={**run_env, **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        found: dict[str, object] = {}
        for service in ("inference", "trainer"):
            out = subprocess.run(["docker", "inspect", "--format", "{{json .HostConfig.DeviceRequests}}",
                                  f"{project}-{service}-1"], capture_output=True, text=True, check=True, timeout=60)
            found[service] = json.loads(out.stdout)
        return found

    yield create
    for args in projects:
        subprocess.run([*args, "down", "-v", "--remove-orphans"], cwd=ROOT, capture_output=True, timeout=300)


def request(*ids: str) -> list[dict[str, object]]:
    return [{**GPU, "DeviceIDs": list(ids), "Options": None}]


def test_split_mode_reserves_one_gpu_per_service_by_id(created: Create) -> None:
    found = created(["compose.yaml"], {"GPU_MODE": "split", "INFERENCE_GPU": "0", "TRAINER_GPU": "1"})
    assert found == {"inference": request("0"), "trainer": request("1")}


def test_shared_mode_reserves_the_same_gpu_for_both(created: Create) -> None:
    found = created(["compose.yaml"], {"GPU_MODE": "shared", "INFERENCE_GPU": "3", "TRAINER_GPU": "3"})
    assert found == {"inference": request("3"), "trainer": request("3")}


def test_cpu_mode_reserves_no_gpu(created: Create) -> None:
    found = created(["compose.yaml", "compose.cpu.yaml"], {"GPU_MODE": "cpu"})
    assert found == {"inference": None, "trainer": None}


def test_several_gpus_for_a_service_are_one_id_per_entry(created: Create, tmp_path: Path) -> None:
    # What docs/operations.md tells a user to put in compose.override.yaml.
    override = tmp_path / "compose.override.yaml"
    override.write_text(
        "services:\n  inference:\n    deploy:\n      resources:\n        reservations:\n          devices: !override\n"
        "            - driver: nvidia\n              capabilities: [gpu]\n              device_ids: [\"0\", \"1\"]\n"
    )
    found = created(["compose.yaml"], {"GPU_MODE": "split", "TRAINER_GPU": "2"}, [override])
    assert found == {"inference": request("0", "1"), "trainer": request("2")}


def test_the_trainer_gpus_file_reserves_four_gpus_for_four_ranks(created: Create) -> None:
    found = created(["compose.yaml", "compose.trainer-gpus.yaml"], {"GPU_MODE": "split", "INFERENCE_GPU": "0"})
    assert found == {"inference": request("0"), "trainer": request("1", "2", "3", "4")}
    names = subprocess.run(["docker", "ps", "-a", "--filter", f"name=tandem-devreq-{os.getpid()}-", "--filter",
                            "label=com.docker.compose.service=trainer", "--format", "{{.Names}}"],
                           capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert len(names) == 1, names  # each test's projects are taken down after it
    env = json.loads(subprocess.run(["docker", "inspect", "--format", "{{json .Config.Env}}", names[0]],
                                    capture_output=True, text=True, check=True, timeout=60).stdout)
    assert {"CUDA_VISIBLE_DEVICES=0,1,2,3", "TANDEM_PARALLEL__RANKS=4"} <= set(env)
