"""Every stack the docs name renders: each documented combination of compose files, for each
engine, through `docker compose config` (Compose v2; no engine, image or GPU needed).

A file meant to sit on top of others can name services only some stacks define (the CPU stack's
`engine` and `model`); rendered on a stack without them, compose refuses the whole project, so a
combination the docs give that does not render is a stack no user can start.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
from pathlib import Path

import pytest
from compose_stack import ROOT
from test_gpu_reservations import compose_v2

pytestmark = pytest.mark.e2e

GPU, CPU = ("compose.yaml",), ("compose.yaml", "compose.cpu.yaml")
#: name -> (the files in order, the services that must be there)
STACKS = {
    "gpu": (GPU, {"redis", "inference", "trainer"}),
    "gpu-replicas": ((*GPU, "compose.replicas.yaml"), {"redis", "inference", "trainer", "router"}),
    "gpu-client": ((*GPU, "compose.client.yaml"), {"redis", "inference", "trainer"}),
    "gpu-trainer-gpus": ((*GPU, "compose.trainer-gpus.yaml"), {"redis", "inference", "trainer"}),
    "cpu": (CPU, {"redis", "inference", "trainer", "engine", "model"}),
    "cpu-trainer-nodes": ((*CPU, "compose.trainer-nodes.yaml"), {"redis", "inference", "trainer", "trainer-peer"}),
    "cpu-replicas": ((*CPU, "compose.replicas.yaml", "compose.replicas-cpu.yaml"),
                     {"redis", "inference", "trainer", "router", "model"}),
}


@pytest.fixture(scope="module")
def env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if compose_v2() is None or compose_v2() < (2, 24):
        pytest.skip("Docker Compose v2.24 or newer is needed; images/install-compose-v2.sh installs it")
    path = tmp_path_factory.mktemp("compose") / ".env"
    example = (ROOT / ".env.example").read_text()  # every required secret set, as `make .env` does
    path.write_text(re.sub(r"^([A-Z_]+)=$", lambda m: f"{m[1]}={secrets.token_hex(8)}", example, flags=re.M))
    return path


@pytest.mark.parametrize("engine", ["", "vllm"])
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_each_documented_stack_renders(stack: str, engine: str, env_file: Path) -> None:
    files, services = STACKS[stack]
    if engine and stack.startswith("cpu"):
        pytest.skip("the CPU stack has one engine, the transformers engine")
    args = ["docker", "compose", "--env-file", str(env_file)]
    for name in files:
        args += ["-f", str(ROOT / name)]
    done = subprocess.run([*args, "config", "--format", "json"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "ENGINE": engine, "INFERENCE_REPLICAS": "2"})
    assert done.returncode == 0, f"{' '.join(files)} with ENGINE={engine!r}: {done.stderr}"
    rendered = json.loads(done.stdout)["services"]
    assert services <= rendered.keys(), sorted(rendered)
    # each service its own role's Redis user (tandem.acl), the engine none
    users = {name: re.match(r"redis://([\w-]*):", (svc.get("environment") or {}).get("TANDEM_REDIS__URL", "redis://none:"))[1]
             for name, svc in rendered.items()}
    expected = {"inference": "tandem-inference", "trainer": "tandem-trainer", "trainer-peer": "tandem-trainer"}
    assert {name: user for name, user in users.items() if user != "none"} == {
        name: user for name, user in expected.items() if name in rendered}, users
    image = rendered["inference"]["image"]
    if stack.startswith("cpu"):
        assert "tandem-inference-cpu:" in image
    else:
        assert re.search(r"tandem-inference(-vllm)?:", image) and ("-vllm:" in image) == (engine == "vllm"), image
