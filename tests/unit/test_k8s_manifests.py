"""The Kubernetes port (deploy/k8s/): every overlay rendered with `kubectl kustomize`, validated
strictly against the Kubernetes schemas (kubernetes-validate, offline), and held to tandem's
policies. No cluster runs here: these manifests are rendered and validated, not applied.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.33.0"
#: compose's image of each base image name, per overlay (compose.yaml; compose.cpu.yaml for cpu)
COMPOSE_IMAGES = {
    "gpu": {"tandem-inference": "tandem-inference:dev", "tandem-trainer": "tandem-trainer:dev",
            "tandem-redis": "tandem-redis:dev", "tandem-router": "tandem-router:dev"},
    "cpu": {"tandem-inference": "tandem-inference-cpu:dev", "tandem-trainer": "tandem-trainer-cpu:dev",
            "tandem-redis": "tandem-redis:dev", "tandem-router": "tandem-router:dev"},
}
WORKLOADS = ("Deployment", "StatefulSet", "Job")


class ComposeLoader(yaml.SafeLoader):
    """Reads compose files, whose `!reset` and `!override` tags (Compose 2.24+) are kept as plain values."""


ComposeLoader.add_multi_constructor("!", lambda loader, _tag, node: (
    loader.construct_mapping(node) if isinstance(node, yaml.MappingNode)
    else loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else loader.construct_scalar(node)))


def compose_file(name: str) -> dict[str, Any]:
    return yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)  # noqa: S506 - SafeLoader plus tags


def tool(name: str) -> str:
    """A dev tool of the venv (`make install` installs the dev extra); missing is a failure, not a skip."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is not installed: `make install` installs the dev extra (pyproject.toml)"
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, check=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] in WORKLOADS]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_every_overlay_validates_strictly_against_the_kubernetes_schemas(
    rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path,
) -> None:
    overlay, docs = rendered
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    checked = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert {d["kind"] for d in docs} >= {"Namespace", "StatefulSet", "Deployment", "Service", "NetworkPolicy",
                                         "PersistentVolumeClaim", "Job"}
    assert all(d["metadata"].get("namespace") == "tandem" for d in docs if d["kind"] != "Namespace")


def test_a_manifest_with_an_unknown_field_is_refused(tmp_path: Path) -> None:
    docs = render("gpu")
    find(docs, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]["probe"] = {}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    checked = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)],
                             capture_output=True, text=True)
    assert checked.returncode != 0 and "probe" in checked.stdout + checked.stderr


def test_gpu_containers_have_gpu_limits_and_cpu_ones_none(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    for kind, name in (("StatefulSet", "inference"), ("Deployment", "trainer")):
        container = find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
        limits = container.get("resources", {}).get("limits", {})
        assert limits.get("nvidia.com/gpu") == (1 if overlay == "gpu" else None), (overlay, name, limits)


def test_images_are_compose_images(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    images = {c["image"] for _, spec in pod_specs(docs) for c in spec["containers"] + spec.get("initContainers", [])}
    assert images <= set(COMPOSE_IMAGES[overlay].values()), images
    compose = compose_file("compose.cpu.yaml" if overlay == "cpu" else "compose.yaml")
    for base_name, image in COMPOSE_IMAGES[overlay].items():
        if base_name == "tandem-router":
            compose_image = compose_file("compose.replicas.yaml")["services"]["router"]["image"]
        elif base_name == "tandem-redis" and overlay == "gpu":
            continue  # compose.yaml takes redis from a registry where one is reachable; the CPU stack builds it
        else:
            compose_image = compose["services"][base_name.removeprefix("tandem-")]["image"]
        expanded = compose_image.replace("${TANDEM_IMAGE_PREFIX:-}", "").replace("${TANDEM_TAG:-dev}", "dev")
        assert expanded == image, (overlay, base_name, compose_image)


def test_environment_agrees_with_compose(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    inference = env_of(find(docs, "StatefulSet", "inference")["spec"]["template"]["spec"]["containers"][0])
    trainer = env_of(find(docs, "Deployment", "trainer")["spec"]["template"]["spec"]["containers"][0])
    assert inference["TANDEM_STORE__ROOT"] == trainer["TANDEM_STORE__ROOT"] == "/adapters"
    assert inference["TANDEM_REDIS__URL"] == trainer["TANDEM_REDIS__URL"] == "redis://:$(REDIS_PASSWORD)@redis:6379/0"
    assert inference["TANDEM_ENGINE__URL"] == "http://127.0.0.1:30000"  # the engine on the pod's loopback
    assert inference["TANDEM_REPLICA__ID"] == "$(POD_NAME)"
    assert trainer["TANDEM_WORKER_NAME"] == "trainer"
    if overlay == "cpu":
        assert (inference["TANDEM_GPUS__MODE"], inference["TANDEM_ENGINE__KIND"], inference["TANDEM_ENGINE__LAUNCH"],
                inference["TANDEM_ENGINE__MODEL"]) == ("cpu", "transformers", "true", "/models/tiny")
        assert (trainer["TANDEM_GPUS__MODE"], trainer["TANDEM_BACKEND__KIND"]) == ("cpu", "peft")
    else:
        assert (inference["TANDEM_GPUS__MODE"], inference["TANDEM_ENGINE__KIND"]) == ("split", "sglang")
        compose = compose_file("compose.yaml")["services"]
        assert compose["inference"]["environment"]["TANDEM_ENGINE__KIND"] == "sglang"
        assert compose["trainer"]["environment"]["TANDEM_WORKER_NAME"] == "trainer"


def test_long_running_containers_have_probes(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            assert "readinessProbe" in container and "livenessProbe" in container, doc["metadata"]["name"]
    inference = find(docs, "StatefulSet", "inference")["spec"]["template"]["spec"]["containers"][0]
    assert inference["readinessProbe"]["httpGet"]["path"] == "/ready"
    startup = inference["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # CUDA-graph capture takes minutes


def test_no_secret_is_inline(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    assert not [d for d in docs if d["kind"] == "Secret"]  # the user creates tandem-secrets
    for _, spec in pod_specs(docs):
        for container in spec["containers"]:
            for name, value in env_of(container).items():
                if any(word in name.split("_") for word in ("PASSWORD", "KEY", "TOKEN", "SECRET", "AUTH")):
                    assert isinstance(value, dict) and "secretKeyRef" in value, (name, value)


def test_nothing_runs_as_root(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    for name, spec in pod_specs(docs):
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0, name
        assert spec.get("automountServiceAccountToken") is False, name
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False and sc.get("capabilities", {}).get("drop") == ["ALL"]
            assert sc.get("runAsUser", pod["runAsUser"]) != 0 and not sc.get("privileged")


def test_network_policies_cover_redis_and_the_replicas(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}

    def allowed_from(component: str) -> list[dict[str, Any]]:
        return [rule for spec in policies.values()
                if spec["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") == component
                for rule in spec.get("ingress", [])]

    redis_from = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                  for rule in allowed_from("redis") for peer in rule["from"]}
    assert redis_from == {"inference", "trainer", "client"}
    inference_rules = allowed_from("inference")
    assert inference_rules and all(rule.get("from") for rule in inference_rules)  # never from anywhere
    assert {p["port"] for rule in inference_rules for p in rule["ports"]} == {8000}  # the gateway, not the engine
    assert [rule for rule in allowed_from("router") if "from" not in rule]  # the one door from outside
    assert not allowed_from("trainer")


def test_the_adapter_volume_is_shared_and_read_only_in_inference(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    modes = find(docs, "PersistentVolumeClaim", "adapters")["spec"]["accessModes"]
    assert modes == (["ReadWriteMany"] if overlay == "gpu" else ["ReadWriteOnce"])  # cpu: one node
    inference = find(docs, "StatefulSet", "inference")["spec"]["template"]["spec"]
    mount = next(m for m in inference["containers"][0]["volumeMounts"] if m["name"] == "adapters")
    claim = next(v for v in inference["volumes"] if v["name"] == "adapters")
    assert mount["readOnly"] is True and claim["persistentVolumeClaim"]["readOnly"] is True
    trainer = find(docs, "Deployment", "trainer")["spec"]["template"]["spec"]["containers"][0]
    assert not next(m for m in trainer["volumeMounts"] if m["name"] == "adapters").get("readOnly")
    shm = next(v for v in inference["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert find(docs, "Deployment", "trainer")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 300
