"""Publish and pull by digest, the path a CI GPU runner takes, on the CPU stack against a real registry.

A Distribution registry (Debian's docker-registry, local_registry.py) on loopback; `make publish`
builds the CPU stack's images (labelled from git), checks each one (tandem-doctor in the Python
images), writes its SBOM and pushes it, recording `<image>=<ref>@sha256:...` in images.env. Then
the local images are removed, `make up IMAGES_ENV=images.env` starts the stack from the registry
by digest (no build, no tag looked up), a run trains a version that the gateway serves, and every
running container's image is the one the registry serves under the recorded digest.

The images are built under a tag of this test's own (TANDEM_TAG) and the stack runs under its own
compose project, so other stacks and images on the machine are left alone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from compose_stack import MODEL, ROOT, ComposeStack, compose_command, docker_answers, role_passwords, wait_for
from helpers.loopback import free_port
from local_registry import LocalRegistry, available, local_registry

from tandem import Client, LoraConfig, OptimizerConfig
from tandem.dev import toy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Every image the CPU stack runs: its services', the router's (REPLICAS=N), rq-dashboard's and Prometheus'.
IMAGES = ("tandem-inference-cpu", "tandem-prometheus", "tandem-redis", "tandem-router", "tandem-rq-dashboard",
          "tandem-trainer-cpu")
# The image each service of the CPU stack runs.
SERVICE_IMAGES = {"redis": "tandem-redis", "engine": "tandem-inference-cpu", "inference": "tandem-inference-cpu",
                  "trainer": "tandem-trainer-cpu", "model": "tandem-trainer-cpu"}
PREFIX = "tandem-e2e"
LABELS = ("source", "revision", "version", "licenses", "created")


@dataclass
class Published:
    registry: LocalRegistry
    out: Path
    refs: dict[str, str]
    """image -> REGISTRY/PREFIX/image@sha256:..., as images.env says."""
    local_tag: str
    env_file: Path
    project: str
    compose: str
    ports: dict[str, int]
    secrets: dict[str, str]

    def make(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """`make ARGS` for the CPU stack of this test's project and env file (never the developer's .env)."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("MAKEFLAGS", "MAKELEVEL", "GPU_MODE", "STACK", "TANDEM_IMAGE_PREFIX", "TANDEM_TAG", "IMAGES_ENV")}
        argv = ["make", "-o", ".env", *args, "STACK=cpu", "GPU_MODE=cpu", f"TANDEM_TAG={self.local_tag}",
                f"COMPOSE={self.compose}"]
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def docker(*args: str, check: bool = True) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=300).stdout.strip()


def image_present(ref: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", ref], capture_output=True, timeout=60).returncode == 0


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    if not docker_answers():
        pytest.skip("no docker engine answers (images/install-docker.sh installs and starts one)")
    if not available():
        pytest.skip("no docker-registry binary: apt-get install docker-registry (Debian's Distribution registry)")
    with local_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def published(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    workdir = tmp_path_factory.mktemp("publish")
    project, tag = f"tandem-e2e-{os.getpid()}-registry", f"e2e-publish-{os.getpid()}"
    ports = {name: free_port() for name in ("GATEWAY_PORT", "REDIS_PORT", "RQ_DASHBOARD_PORT")}
    keys = {"REDIS_PASSWORD": secrets.token_hex(16), "ENGINE_ADMIN_KEY": secrets.token_hex(16), **role_passwords()}
    env_file = workdir / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in {**keys, **ports, "TANDEM_TAG": tag}.items()))
    p = Published(registry=registry, out=workdir / "out", refs={}, local_tag=tag, env_file=env_file, project=project,
                  compose=" ".join([*compose_command(), "--env-file", str(env_file), "-p", project]),
                  ports=ports, secrets=keys)
    source = subprocess.run(["git", "remote", "get-url", "origin"], cwd=ROOT, capture_output=True, text=True)
    source_arg = [] if source.returncode == 0 else [f"IMAGE_SOURCE=file://{ROOT}"]
    t0 = time.monotonic()
    done = p.make("publish", f"REGISTRY={registry.host}/{PREFIX}", f"PUBLISH_DIR={p.out}", "PUBLISH_TAGS=e2e",
                  *source_arg, timeout_s=2400)
    print(f"\nmake publish: {time.monotonic() - t0:.0f} s (building included)\n" + done.stdout[-1500:])
    try:
        assert done.returncode == 0, f"make publish failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        for line in (p.out / "images.env").read_text().splitlines():
            name, _, ref = line.partition("=")
            p.refs[name] = ref
        yield p
    finally:
        for image in IMAGES:  # what the stack fixture has not removed already
            docker("image", "rm", f"{image}:{tag}", f"{registry.host}/{PREFIX}/{image}:e2e", check=False)


def test_publish_records_each_digest_with_labels_and_an_sbom(published: Published) -> None:
    reg = published.registry
    assert sorted(published.refs) == sorted(IMAGES), published.refs
    revision = git("rev-parse", "HEAD")
    for image, ref in published.refs.items():
        m = re.fullmatch(rf"{re.escape(reg.host)}/{PREFIX}/{image}@(sha256:[0-9a-f]{{64}})", ref)
        assert m, f"images.env: {image}={ref}"
        # the digest images.env records is the one the registry serves for the pushed tag
        digest, manifest = reg.manifest(f"{PREFIX}/{image}", "e2e")
        assert digest == m[1]
        # the image's labels, from git
        labels = json.loads(docker("image", "inspect", "--format", "{{json .Config.Labels}}", f"{image}:{published.local_tag}"))
        oci = {k: labels.get(f"org.opencontainers.image.{k}", "") for k in LABELS}
        assert all(oci.values()), oci
        assert oci["revision"] == revision
        assert oci["created"] == git("log", "-1", "--format=%cI")
        assert docker("image", "inspect", "--format", "{{.Id}}", f"{image}:{published.local_tag}") == manifest["config"]["digest"]
        # its SBOM, beside images.env
        sbom = json.loads((published.out / "sbom" / f"{image}.cdx.json").read_text())
        assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] == "1.6"
        assert sbom["metadata"]["component"] == {"type": "container", "bom-ref": image, "name": image,
                                                 "version": oci["version"]}
        purls = {c["purl"].split("@")[0] for c in sbom["components"]}
        assert {"pkg:deb/debian/base-files", "pkg:deb/debian/libc6"} <= purls, sorted(purls)[:20]
        wanted = {"tandem-redis": "pkg:deb/debian/redis-server", "tandem-inference-cpu": "pkg:pypi/transformers",
                  "tandem-trainer-cpu": "pkg:pypi/peft", "tandem-router": "pkg:deb/debian/haproxy",
                  "tandem-rq-dashboard": "pkg:pypi/rq-dashboard", "tandem-prometheus": "pkg:deb/debian/prometheus"}[image]
        assert wanted in purls, sorted(purls)[:20]
    for image, lock in (("tandem-trainer-cpu", "cpu-trainer"), ("tandem-inference-cpu", "cpu-inference"),
                        ("tandem-rq-dashboard", "rq-dashboard")):
        sbom = json.loads((published.out / "sbom" / f"{image}.cdx.json").read_text())
        locked = {line.split("==")[0].lower(): line.split("==")[1].split()[0]
                  for line in (ROOT / f"images/locks/{lock}.txt").read_text().splitlines() if "==" in line}
        listed = {c["name"].lower(): c["version"] for c in sbom["components"] if c["purl"].startswith("pkg:pypi/")}
        assert listed == locked, image  # every pin of the lock the image was built from, at its version


def test_publish_pins_the_cpu_overlay_by_digest(published: Published) -> None:
    """`make publish` writes k8s/, the cpu overlay with every image it runs set to its digest."""
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or "kubectl"  # the dev extra's
    out = subprocess.run([kubectl, "kustomize", str(published.out / "k8s")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    images = set(re.findall(r"^\s+image: (\S+)$", out.stdout, re.M))
    assert images and images <= set(published.refs.values()), images


def test_an_image_whose_check_fails_is_not_published(published: Published, tmp_path: Path) -> None:
    """peft removed from the trainer's environment: tandem-doctor fails, and nothing is pushed."""
    broken = f"tandem-e2e-broken:{published.local_tag}"
    (tmp_path / "Dockerfile").write_text(
        f"FROM tandem-trainer-cpu:{published.local_tag}\nUSER root\n"
        "RUN rm -rf /opt/tandem/lib/python3.11/site-packages/peft /opt/tandem/lib/python3.11/site-packages/peft-*\n"
        "USER tandem\n")
    docker("build", "-q", "-t", broken, str(tmp_path))
    try:
        done = subprocess.run(["images/publish.sh", "push", "--registry", f"{published.registry.host}/{PREFIX}",
                               "--out", str(tmp_path / "out"), "--local-tag", published.local_tag, "--tag", "e2e",
                               "tandem-e2e-broken"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        docker("image", "rm", broken, check=False)
    assert done.returncode != 0
    assert "its in-image check `tandem-doctor` failed" in done.stderr, done.stderr[-2000:]
    assert "missing: peft" in done.stderr
    assert f"{PREFIX}/tandem-e2e-broken" not in published.registry.repositories()
    assert not (tmp_path / "out" / "images.env").exists()


@pytest.fixture(scope="module")
def stack(published: Published, request: pytest.FixtureRequest) -> Iterator[ComposeStack]:
    """The CPU stack started by `make up IMAGES_ENV=...` from the registry, with no local image to fall back on."""
    for image in IMAGES:
        docker("image", "rm", f"{image}:{published.local_tag}", f"{published.registry.host}/{PREFIX}/{image}:e2e")
    for image, ref in published.refs.items():
        assert not image_present(ref), f"{image} is still on this machine ({ref}): the stack would not be pulled"
    s = ComposeStack(
        project=published.project, env_file=published.env_file,
        gateway_url=f"http://127.0.0.1:{published.ports['GATEWAY_PORT']}",
        redis_url=(f"redis://tandem-client:{published.secrets['REDIS_CLIENT_PASSWORD']}"
                   f"@127.0.0.1:{published.ports['REDIS_PORT']}/0"),
        redis_password=published.secrets["REDIS_PASSWORD"], engine_admin_key=published.secrets["ENGINE_ADMIN_KEY"],
        role_passwords={k: v for k, v in published.secrets.items() if k.startswith("REDIS_") and k != "REDIS_PASSWORD"},
        dashboard_url=f"http://127.0.0.1:{published.ports['RQ_DASHBOARD_PORT']}",
    )
    failed_before = request.session.testsfailed
    try:
        t0 = time.monotonic()
        done = published.make("up", "CLIENT=1", f"IMAGES_ENV={published.out / 'images.env'}", timeout_s=900)
        assert done.returncode == 0, f"make up failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        assert " build" not in done.stdout, done.stdout
        # later compose calls (ps, logs, exec, down) see the same images as `make up` did
        pins = subprocess.run(["images/publish.sh", "compose-env", str(published.out / "images.env")], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        with published.env_file.open("a") as f:
            f.write(pins)
        s.wait_healthy()
        wait_for(lambda: httpx.get(f"{s.gateway_url}/ready", timeout=3).status_code == 200, 60, "the gateway to be ready")
        print(f"\nmake up from {published.registry.host} by digest: {time.monotonic() - t0:.0f} s")
        yield s
    finally:
        logs = s.logs()
        out = ROOT / ".tandem" / "e2e" / f"{s.project}.log"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(logs)
        if request.session.testsfailed > failed_before:
            print(f"\n===== docker-compose logs ({s.project}) =====\n{logs}")
        s.compose("down", "-v", "--remove-orphans", "-t", "30", check=False, timeout_s=300)
        for ref in published.refs.values():
            docker("image", "rm", ref, check=False)


def test_every_container_runs_the_published_digest(stack: ComposeStack, published: Published) -> None:
    for service, image in SERVICE_IMAGES.items():
        ref = published.refs[image]
        repository, _, digest = ref.partition("@")
        _, manifest = published.registry.manifest(repository.split("/", 1)[1], digest)
        for cid in stack.containers(service):
            configured, image_id = docker("inspect", "--format", "{{.Config.Image}} {{.Image}}", cid).split()
            assert configured == ref, (service, configured)
            assert image_id == manifest["config"]["digest"], (service, image_id)
            repo_digests = json.loads(docker("image", "inspect", "--format", "{{json .RepoDigests}}", image_id))
            assert ref in repo_digests, (service, repo_digests)


def test_a_version_trains_and_serves(stack: ComposeStack, client: Client, digits: frozenset[int]) -> None:
    run = client.create_run("published", base_model=MODEL, lora=LoraConfig(r=8, alpha=16),
                            optimizer=OptimizerConfig(lr=5e-3), max_staleness_steps=0)
    for step in range(1, 4):
        rolled = toy.roll_out(run, digits, toy.prompts_for(step, 4))
        assert sorted(set(rolled.versions)) == [step - 1]
        assert run.train(rolled.groups).version == step
    body = {"model": "published", "messages": [{"role": "user", "content": "Count for me."}], "max_tokens": 2}
    resp = httpx.post(f"{stack.gateway_url}/v1/chat/completions", json=body, timeout=30)
    resp.raise_for_status()
    assert resp.json()["tandem"]["version"] == 3
