"""images/publish.sh without a registry: images.env turned into the variables compose pins each
image with, its refusals (a line that is not IMAGE=REF@sha256:..., a registry that is not
HOST[:PORT][/PREFIX]), and what `make -n up IMAGES_ENV=...` runs. Pushing and pulling against a
real registry is tests/e2e/test_registry_publish.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "images" / "publish.sh"
DIGEST = "sha256:" + "ab" * 32


class _Loader(yaml.SafeLoader):
    """Reads compose's `!reset` / `!override` tags as plain values."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def publish(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_images_env_becomes_one_pinned_variable_per_image(tmp_path: Path) -> None:
    env = tmp_path / "images.env"
    env.write_text(f"tandem-inference-cpu=127.0.0.1:5000/x/tandem-inference-cpu@{DIGEST}\n"
                   f"tandem-redis=ghcr.io/acme/tandem-redis@{DIGEST}\n")
    done = publish("compose-env", str(env))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"TANDEM_INFERENCE_CPU_IMAGE=127.0.0.1:5000/x/tandem-inference-cpu@{DIGEST}",
                                        f"TANDEM_REDIS_IMAGE=ghcr.io/acme/tandem-redis@{DIGEST}"]


def test_every_published_image_has_the_variable_its_compose_file_reads() -> None:
    """compose-env's TANDEM_<IMAGE>_IMAGE is what each service's `image:` reads first, before prefix and tag."""
    refs = [service["image"] for name in ("compose.yaml", "compose.cpu.yaml", "compose.replicas.yaml")
            for service in yaml.load((ROOT / name).read_text(), Loader=_Loader)["services"].values()
            if "tandem-" in (service or {}).get("image", "")]
    makefile = (ROOT / "Makefile").read_text()
    stack_images = {i for line in makefile.splitlines() if line.startswith("STACK_IMAGES_")
                    for i in re.findall(r"tandem-[a-z-]*[a-z]", line.split("=", 1)[1])}  # make's $(if ...) left out
    assert stack_images == {"tandem-redis", "tandem-inference-cpu", "tandem-trainer-cpu", "tandem-inference", "tandem-trainer"}
    for image in stack_images | {"tandem-router", "tandem-rq-dashboard"}:
        var = image.upper().replace("-", "_") + "_IMAGE"
        # the inference image is named by ENGINE too (unset: SGLang's; vllm: tandem-inference-vllm)
        engine = "${ENGINE:+-}${ENGINE:-}" if image == "tandem-inference" else ""
        uses = [ref for ref in refs if f"}}{image}{engine}:" in ref]
        assert uses, image
        expected = f"${{{var}:-${{TANDEM_IMAGE_PREFIX:-}}{image}{engine}:${{TANDEM_TAG:-dev}}}}"
        assert all(ref == expected for ref in uses), (image, uses)


@pytest.mark.parametrize("line", ["tandem-redis=ghcr.io/acme/tandem-redis:main",         # a tag, not a digest
                                  f"redis=ghcr.io/acme/redis@{DIGEST}",                   # not a tandem image
                                  "tandem-redis=ghcr.io/acme/tandem-redis@sha256:abc"])   # not 64 hex
def test_a_line_that_pins_nothing_is_refused_by_name(tmp_path: Path, line: str) -> None:
    env = tmp_path / "images.env"
    env.write_text(line + "\n")
    done = publish("compose-env", str(env))
    assert done.returncode != 0
    assert f"'{line}' is not IMAGE=REGISTRY/IMAGE@sha256:<64 hex>" in done.stderr


def test_a_missing_or_empty_images_env_is_refused(tmp_path: Path) -> None:
    assert "no file" in publish("compose-env", str(tmp_path / "nowhere.env")).stderr
    (tmp_path / "empty.env").write_text("# nothing\n")
    assert "names no image" in publish("compose-env", str(tmp_path / "empty.env")).stderr


@pytest.mark.parametrize("registry", ["GHCR.io/Acme", "https://ghcr.io/acme", "ghcr.io:port"])
def test_a_registry_that_is_not_host_port_prefix_is_refused(registry: str) -> None:
    done = publish("push", "--registry", registry, "tandem-redis")
    assert done.returncode != 0
    assert f"--registry '{registry}' is not HOST[:PORT][/PREFIX]" in done.stderr


def test_make_up_with_images_env_pulls_the_digests_and_builds_nothing(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    env = tmp_path / "images.env"
    env.write_text(f"tandem-inference=ghcr.io/acme/tandem-inference@{DIGEST}\ntandem-trainer=ghcr.io/acme/tandem-trainer@{DIGEST}\n")
    shutil.copy(ROOT / ".env.example", tmp_path / ".env.example")
    (tmp_path / ".env").write_text("REDIS_PASSWORD=x\n")
    dropped = ("GPU_MODE", "STACK", "TANDEM_IMAGE_PREFIX", "MAKEFLAGS", "MAKELEVEL")
    base = {k: v for k, v in os.environ.items() if k not in dropped}
    done = subprocess.run(["make", "-n", "-f", str(ROOT / "Makefile"), "up", "GPU_MODE=split", f"IMAGES_ENV={env}"],
                          cwd=tmp_path, capture_output=True, text=True, env=base, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [" ".join(line.split()) for line in done.stdout.splitlines()]
    pins = (f"TANDEM_INFERENCE_IMAGE=ghcr.io/acme/tandem-inference@{DIGEST} "
            f"TANDEM_TRAINER_IMAGE=ghcr.io/acme/tandem-trainer@{DIGEST}")
    assert any(pins in line and line.endswith("docker compose -f compose.yaml pull --quiet") for line in lines), lines
    assert any(pins in line and line.endswith("up -d --no-build --pull never") for line in lines), lines
    assert not any(line.endswith(" build") or "build-base.sh" in line for line in lines), lines


def test_make_with_a_bad_images_env_says_what_is_wrong(tmp_path: Path) -> None:
    env = tmp_path / "images.env"
    env.write_text("tandem-trainer=ghcr.io/acme/tandem-trainer:main\n")
    done = subprocess.run(["make", "-n", "-f", str(ROOT / "Makefile"), "up", f"IMAGES_ENV={env}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "'tandem-trainer=ghcr.io/acme/tandem-trainer:main' is not IMAGE=REGISTRY/IMAGE@sha256" in done.stderr
