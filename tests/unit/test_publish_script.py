"""images/publish.sh without a registry: images.env turned into the variables compose pins each
image with and into the Kubernetes overlay by digest, its refusals (a line that is not
IMAGE=REF@sha256:..., a registry that is not HOST[:PORT][/PREFIX]), what `make -n up IMAGES_ENV=...`
runs, and that `make publish` pushes every image a stack runs (compose's services, profiles and
router; the stack's Kubernetes overlay). Pushing and pulling against a real registry is
tests/e2e/test_registry_publish.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.compose_yaml import ComposeTags

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "images" / "publish.sh"
DIGEST = "sha256:" + "ab" * 32


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
            for service in yaml.load((ROOT / name).read_text(), Loader=ComposeTags)["services"].values()
            if "tandem-" in (service or {}).get("image", "")]
    makefile = (ROOT / "Makefile").read_text()
    stack_images = {i for line in makefile.splitlines() if line.startswith("STACK_IMAGES_")
                    for i in re.findall(r"tandem-[a-z-]*[a-z]", line.split("=", 1)[1])}  # make's $(if ...) left out
    assert stack_images == {"tandem-redis", "tandem-inference-cpu", "tandem-trainer-cpu", "tandem-inference", "tandem-trainer",
                            "tandem-router", "tandem-rq-dashboard", "tandem-prometheus"}
    for image in stack_images:
        var = image.upper().replace("-", "_") + "_IMAGE"
        # the inference image is named by ENGINE too (unset: SGLang's; vllm: tandem-inference-vllm)
        engine = "${ENGINE:+-}${ENGINE:-}" if image == "tandem-inference" else ""
        uses = [ref for ref in refs if f"}}{image}{engine}:" in ref]
        assert uses, image
        expected = f"${{{var}:-${{TANDEM_IMAGE_PREFIX:-}}{image}{engine}:${{TANDEM_TAG:-dev}}}}"
        assert all(ref == expected for ref in uses), (image, uses)


#: The compose files of each stack: `make up`'s (CLIENT=1, REPLICAS=N) and the documented add-ons.
STACK_FILES = {
    "cpu": ("compose.yaml", "compose.cpu.yaml", "compose.client.yaml", "compose.replicas.yaml",
            "compose.replicas-cpu.yaml", "compose.trainer-nodes.yaml"),
    "gpu": ("compose.yaml", "compose.client.yaml", "compose.replicas.yaml", "compose.trainer-gpus.yaml"),
}


def published_by_make(stack: str, engine: str = "") -> list[str]:
    """The images `make publish STACK=<stack>` pushes (what `make -n` prints it would run)."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    base = {k: v for k, v in os.environ.items() if k not in ("GPU_MODE", "STACK", "ENGINE", "MAKEFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-n", "publish", "REGISTRY=registry.example/acme", "IMAGE_SOURCE=https://example/x",
                           f"STACK={stack}", f"GPU_MODE={'cpu' if stack == 'cpu' else 'split'}", f"ENGINE={engine}",
                           "-o", ".env", "-o", "compose-v2", "-o", "tools"],
                          cwd=ROOT, capture_output=True, text=True, env=base, timeout=60)
    assert done.returncode == 0, done.stderr
    push = re.search(r"images/publish\.sh push .*?--local-tag \S+ \\\n(.*)", done.stdout)
    assert push, done.stdout
    return push[1].split()


def images_a_stack_runs(stack: str) -> dict[str, str]:
    """Each service of the stack's compose files (every profile) -> its `image:`, the last file's."""
    images: dict[str, str] = {}
    for name in STACK_FILES[stack]:
        for service, spec in yaml.load((ROOT / name).read_text(), Loader=ComposeTags)["services"].items():
            if spec and "image" in spec:
                images[service] = spec["image"]
    return images


def test_every_compose_file_belongs_to_a_stack() -> None:
    listed = {name for files in STACK_FILES.values() for name in files}
    assert {p.name for p in ROOT.glob("compose*.yaml")} == listed


#: The Kubernetes overlay of each stack and engine (what `make publish` pins by digest).
OVERLAYS = {("cpu", ""): "cpu", ("gpu", ""): "gpu", ("gpu", "vllm"): "gpu-vllm"}


def with_components(tmp_path: Path, overlay: str) -> Path:
    """A copy of deploy/k8s with the overlay's optional components enabled, as a user uncomments them;
    the overlay's directory in it."""
    k8s = tmp_path / "k8s"
    if not k8s.exists():
        shutil.copytree(ROOT / "deploy" / "k8s", k8s)
    kustomization = k8s / "overlays" / ("gpu" if overlay == "gpu-vllm" else overlay) / "kustomization.yaml"
    kustomization.write_text(re.sub(r"^# (components:\n)((?:#   - .*\n)+)",
                                    lambda m: m[1] + m[2].replace("#", "", m[2].count("\n")),
                                    kustomization.read_text(), flags=re.M))
    return k8s / "overlays" / overlay


@pytest.mark.parametrize(("stack", "engine"), list(OVERLAYS))
def test_make_publish_pushes_every_image_the_stack_runs(stack: str, engine: str, tmp_path: Path) -> None:
    """Every service of every compose file of the stack, profiles (rq-dashboard, Prometheus) and the router
    included, reads a TANDEM_<IMAGE>_IMAGE that `make publish` writes, and every image of the stack's
    Kubernetes overlay (its components too) is pushed: nothing either runs is left to a tag, and nothing
    is pushed that neither runs."""
    published = published_by_make(stack, engine)
    assert len(published) == len(set(published)), published
    runs = images_a_stack_runs(stack)
    assert {"redis", "inference", "trainer", "router", "rq-dashboard", "prometheus"} <= runs.keys(), sorted(runs)
    compose = set()
    for service, image in runs.items():
        if stack == "gpu" and service == "redis":  # upstream Redis 7.2 (REDIS_IMAGE): the next test
            continue
        var = re.match(r"^\$\{(TANDEM_[A-Z_]+_IMAGE):-", image)
        assert var, f"{stack}: service {service}'s image {image!r} reads no TANDEM_<IMAGE>_IMAGE"
        name = "tandem-" + var[1].removeprefix("TANDEM_").removesuffix("_IMAGE").lower().replace("_", "-")
        if name == "tandem-inference" and engine:  # make up maps TANDEM_INFERENCE_<ENGINE>_IMAGE onto it
            name = f"tandem-inference-{engine}"
        assert name in published, f"{stack} {engine}: {service} runs {name}, which make publish does not push"
        compose.add(name)
    kubernetes = {image.split(":")[0] for image in kustomize_images(with_components(tmp_path, OVERLAYS[stack, engine]))}
    assert kubernetes <= set(published), f"{OVERLAYS[stack, engine]} runs {sorted(kubernetes - set(published))}, not pushed"
    assert compose | kubernetes == set(published)


def test_the_gpu_stacks_compose_redis_is_upstream_by_tag() -> None:
    """compose.yaml's Redis on GPUs stays the upstream 7.2 (pinned by REDIS_IMAGE, a digest there if
    wanted): tandem-redis is Debian's 7.0, which could not read the files 7.2 wrote."""
    assert images_a_stack_runs("gpu")["redis"] == "${REDIS_IMAGE:-redis:7.2.7-bookworm}"


def kustomize_images(directory: Path) -> set[str]:
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert kubectl, "kubectl is not installed: `make install` installs the dev extra (pyproject.toml)"
    out = subprocess.run([kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(directory)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {c["image"] for doc in yaml.safe_load_all(out.stdout) if doc and doc["kind"] in ("Deployment", "StatefulSet", "Job")
            for c in doc["spec"]["template"]["spec"]["containers"] + doc["spec"]["template"]["spec"].get("initContainers", [])}


@pytest.mark.parametrize(("stack", "engine"), list(OVERLAYS))
def test_make_publish_pins_the_stacks_kubernetes_overlay_by_digest(stack: str, engine: str, tmp_path: Path) -> None:
    """`images/publish.sh kustomize` (which `make publish` runs on the stack's overlay) sets every image
    of the overlay, its optional components' included, to the digest images.env records."""
    overlay = with_components(tmp_path, OVERLAYS[stack, engine])
    published = published_by_make(stack, engine)
    env = tmp_path / "images.env"
    env.write_text("".join(f"{image}=registry.example/acme/{image}@{DIGEST}\n" for image in sorted(published)))
    done = publish("kustomize", str(env), str(overlay), str(tmp_path / "pinned"))
    assert done.returncode == 0, done.stderr
    runs = {image.split(":")[0] for image in kustomize_images(overlay)}
    assert kustomize_images(tmp_path / "pinned") == {f"registry.example/acme/{image}@{DIGEST}" for image in runs}


def test_kustomize_refuses_what_compose_env_refuses(tmp_path: Path) -> None:
    env = tmp_path / "images.env"
    env.write_text("tandem-redis=ghcr.io/acme/tandem-redis:main\n")
    done = publish("kustomize", str(env), str(ROOT / "deploy" / "k8s" / "overlays" / "cpu"), str(tmp_path / "out"))
    assert done.returncode != 0 and "is not IMAGE=REGISTRY/IMAGE@sha256" in done.stderr
    assert not (tmp_path / "out").exists()
    env.write_text(f"tandem-redis=ghcr.io/acme/tandem-redis@{DIGEST}\n")
    done = publish("kustomize", str(env), str(tmp_path), str(tmp_path / "out"))
    assert done.returncode != 0 and "has no kustomization.yaml" in done.stderr


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


def make_up_pinned(tmp_path: Path, images_env: str, *args: str) -> list[str]:
    """What `make -n up GPU_MODE=split IMAGES_ENV=... ARGS` would run, in a directory with a .env;
    each line's spaces squeezed."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    env = tmp_path / "images.env"
    env.write_text(images_env)
    shutil.copy(ROOT / ".env.example", tmp_path / ".env.example")
    (tmp_path / ".env").write_text("REDIS_PASSWORD=x\n")
    dropped = ("GPU_MODE", "STACK", "TANDEM_IMAGE_PREFIX", "MAKEFLAGS", "MAKELEVEL")
    base = {k: v for k, v in os.environ.items() if k not in dropped}
    done = subprocess.run(["make", "-n", "-f", str(ROOT / "Makefile"), "up", "GPU_MODE=split", f"IMAGES_ENV={env}", *args],
                          cwd=tmp_path, capture_output=True, text=True, env=base, timeout=60)
    assert done.returncode == 0, done.stderr
    return [" ".join(line.split()) for line in done.stdout.splitlines()]


def test_make_up_with_images_env_pulls_the_digests_and_builds_nothing(tmp_path: Path) -> None:
    lines = make_up_pinned(tmp_path, f"tandem-inference=ghcr.io/acme/tandem-inference@{DIGEST}\n"
                                     f"tandem-trainer=ghcr.io/acme/tandem-trainer@{DIGEST}\n")
    pins = (f"TANDEM_INFERENCE_IMAGE=ghcr.io/acme/tandem-inference@{DIGEST} "
            f"TANDEM_TRAINER_IMAGE=ghcr.io/acme/tandem-trainer@{DIGEST}")
    assert any(pins in line and line.endswith("docker compose -f compose.yaml pull --quiet") for line in lines), lines
    assert any(pins in line and line.endswith("up -d --no-build --pull never") for line in lines), lines
    assert not any(line.endswith(" build") or "build-base.sh" in line for line in lines), lines


def test_make_up_with_images_env_and_profiles_checks_and_pulls_the_profiles_images(tmp_path: Path) -> None:
    """PROFILES=metrics runs Prometheus: its image is among those checked for a digest and pulled."""
    lines = make_up_pinned(tmp_path, f"tandem-prometheus=ghcr.io/acme/tandem-prometheus@{DIGEST}\n", "PROFILES=metrics")
    assert any("--profile metrics config --images" in line for line in lines), lines
    assert any(line.endswith("--profile metrics pull --quiet") for line in lines), lines


def test_make_with_a_bad_images_env_says_what_is_wrong(tmp_path: Path) -> None:
    env = tmp_path / "images.env"
    env.write_text("tandem-trainer=ghcr.io/acme/tandem-trainer:main\n")
    done = subprocess.run(["make", "-n", "-f", str(ROOT / "Makefile"), "up", f"IMAGES_ENV={env}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "'tandem-trainer=ghcr.io/acme/tandem-trainer:main' is not IMAGE=REGISTRY/IMAGE@sha256" in done.stderr
