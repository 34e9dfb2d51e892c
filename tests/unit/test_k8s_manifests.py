"""The Kubernetes port (deploy/k8s/): every overlay rendered with `kubectl kustomize`, validated
strictly against the Kubernetes schemas (kubernetes-validate, offline), and held to tandem's
policies. No cluster runs here: these manifests are rendered and validated, not applied.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "gpu")
#: each overlay as it is, and with its optional components (the commented `components:` of its kustomization)
VARIANTS = (*OVERLAYS, *(f"{overlay}+components" for overlay in OVERLAYS))
KUBERNETES_VERSION = "1.33.0"
#: compose's image of each base image name, per overlay (compose.yaml; compose.cpu.yaml for cpu)
COMPOSE_IMAGES = {
    "gpu": {
        "tandem-inference": "tandem-inference:dev",
        "tandem-trainer": "tandem-trainer:dev",
        "tandem-redis": "tandem-redis:dev",
        "tandem-router": "tandem-router:dev",
        "tandem-rq-dashboard": "tandem-rq-dashboard:dev",
        # the Tinker service's on every overlay (components/tinker; compose.yaml's `tinker`)
        "tandem-inference-cpu": "tandem-inference-cpu:dev",
    },
    "cpu": {
        "tandem-inference": "tandem-inference-cpu:dev",
        "tandem-trainer": "tandem-trainer-cpu:dev",
        "tandem-redis": "tandem-redis:dev",
        "tandem-router": "tandem-router:dev",
        "tandem-rq-dashboard": "tandem-rq-dashboard:dev",
        "tandem-inference-cpu": "tandem-inference-cpu:dev",
    },
}
WORKLOADS = ("Deployment", "StatefulSet", "Job")


class ComposeLoader(yaml.SafeLoader):
    """Reads compose files, whose `!reset` and `!override` tags (Compose 2.24+) are kept as plain values."""


ComposeLoader.add_multi_constructor(
    "!",
    lambda loader, _tag, node: (
        loader.construct_mapping(node)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_sequence(node)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_scalar(node)
    ),
)


def compose_file(name: str) -> dict[str, Any]:
    return yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)  # noqa: S506 - SafeLoader plus tags


def tool(name: str) -> str:
    """A dev tool of the venv (`make install` installs the dev extra); missing is a failure, not a skip."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is not installed: `make install` installs the dev extra (pyproject.toml)"
    return found


def render(overlay: str, *, components: bool = False) -> list[dict[str, Any]]:
    """`kubectl kustomize` of an overlay; with `components`, of the overlay with its commented
    `components:` lines uncommented, as a user enables them (in a scratch copy, its paths rewritten)."""
    directory = ROOT / "deploy" / "k8s" / "overlays" / overlay
    with tempfile.TemporaryDirectory() as scratch:
        if components:
            text = (directory / "kustomization.yaml").read_text()
            enabled = re.sub(
                r"^# (components:\n)((?:#   - .*\n)+)",
                lambda m: m[1] + m[2].replace("#", "", m[2].count("\n")),
                text,
                flags=re.MULTILINE,
            )
            assert enabled != text, f"{overlay}'s kustomization.yaml names no optional components"
            kustomization = yaml.safe_load(enabled)

            def moved(path: str) -> str:  # kustomize takes relative paths only
                return os.path.relpath((directory / path).resolve(), Path(scratch).resolve())

            for key in ("resources", "components"):
                kustomization[key] = [moved(path) for path in kustomization.get(key, [])]
            for patch in kustomization.get("patches", []):
                if "path" in patch:
                    patch["path"] = moved(patch["path"])
            (Path(scratch) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
            directory = Path(scratch)
        out = subprocess.run(
            [tool("kubectl"), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(directory)],
            capture_output=True,
            text=True,
        )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=VARIANTS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    overlay, _, components = request.param.partition("+")
    return overlay, render(overlay, components=bool(components))


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] in WORKLOADS]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_every_overlay_validates_strictly_against_the_kubernetes_schemas(
    rendered: tuple[str, list[dict[str, Any]]],
    tmp_path: Path,
) -> None:
    overlay, docs = rendered
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert {d["kind"] for d in docs} >= {
        "Namespace",
        "StatefulSet",
        "Deployment",
        "Service",
        "NetworkPolicy",
        "PersistentVolumeClaim",
    }
    jobs = {d["metadata"]["name"] for d in docs if d["kind"] == "Job"}
    assert jobs - {"toy-task"} == ({"tiny-model"} if overlay == "cpu" else set())  # toy-task: its component's
    assert all(d["metadata"].get("namespace") == "tandem" for d in docs if d["kind"] != "Namespace")


def test_a_manifest_with_an_unknown_field_is_refused(tmp_path: Path) -> None:
    docs = render("gpu")
    find(docs, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]["probe"] = {}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)], capture_output=True, text=True
    )
    assert checked.returncode != 0 and "probe" in checked.stdout + checked.stderr


def test_gpu_containers_have_gpu_limits_and_cpu_ones_none(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    for kind, name in (("StatefulSet", "inference"), ("Deployment", "trainer")):
        container = find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
        limits = container.get("resources", {}).get("limits", {})
        assert limits.get("nvidia.com/gpu") == (1 if overlay == "gpu" else None), (overlay, name, limits)


def trainer_settings_accept(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's settings, read from this environment (its plain values), pass their checks:
    as in the container, where a failing check stops the trainer and its probes before anything runs."""
    from tandem.settings import TrainerSettings

    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if isinstance(value, str) and name.startswith("TANDEM_"):
            monkeypatch.setenv(name, value)
    TrainerSettings()


def test_a_data_parallel_trainer_has_a_rank_per_gpu_it_sees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render("gpu-trainer-gpus")
    path = tmp_path / "gpu-trainer-gpus.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    gpu = render("gpu")
    assert [d for d in docs if d["metadata"]["name"] != "trainer"] == [d for d in gpu if d["metadata"]["name"] != "trainer"]
    container = find(docs, "Deployment", "trainer")["spec"]["template"]["spec"]["containers"][0]
    env = env_of(container)
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus > 1
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(str(i) for i in range(gpus))
    assert env["TANDEM_PARALLEL__RANKS"] == str(gpus)
    assert [e["name"] for e in container["env"]].count("CUDA_VISIBLE_DEVICES") == 1  # replaced, not added
    compose = compose_file("compose.trainer-gpus.yaml")["services"]["trainer"]
    [device] = compose["deploy"]["resources"]["reservations"]["devices"]
    assert len(device["device_ids"]) == gpus  # the same count as compose's file for several GPUs
    expected = compose_environment("gpu", "trainer") | compose["environment"]
    differing = {k: (v, env.get(k)) for k, v in expected.items()
                 if k not in KUBERNETES_ONLY and not isinstance(env.get(k), dict) and env.get(k) != compose_default(v)}
    assert not differing
    trainer_settings_accept(env, monkeypatch)  # ranks=4 with one trainer GPU listed stopped the trainer
    trainer_settings_accept({k: compose_default(v) for k, v in expected.items()}, monkeypatch)


def test_the_vllm_overlay_is_the_gpu_one_with_vllms_image_and_kind(tmp_path: Path) -> None:
    """deploy/k8s/overlays/gpu-vllm (the vllm component over the gpu overlay) validates strictly and
    differs from the gpu overlay only in the inference image and engine, which are compose's with ENGINE=vllm."""
    docs = render("gpu-vllm")
    path = tmp_path / "gpu-vllm.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    gpu = render("gpu")
    assert [d for d in docs if d["metadata"]["name"] != "inference"] == [d for d in gpu if d["metadata"]["name"] != "inference"]
    [container] = find(docs, "StatefulSet", "inference")["spec"]["template"]["spec"]["containers"]
    [sglang] = find(gpu, "StatefulSet", "inference")["spec"]["template"]["spec"]["containers"]
    compose = compose_file("compose.yaml")["services"]["inference"]
    assert container["image"] == compose_image_named(compose["image"], "vllm") == "tandem-inference-vllm:dev"
    env, sglang_env = env_of(container), env_of(sglang)
    assert env["TANDEM_ENGINE__KIND"] == compose["environment"]["TANDEM_ENGINE__KIND"].replace("${ENGINE:-sglang}", "vllm")
    assert {k: v for k, v in env.items() if sglang_env.get(k) != v} == {
        "TANDEM_ENGINE__KIND": "vllm", "VLLM_CACHE_ROOT": "/home/tandem/.cache/vllm"}
    # the root filesystem is read-only: vLLM's kernel cache lies on a writable volume of the pod
    writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
    assert any(env["VLLM_CACHE_ROOT"].startswith(path + "/") for path in writable), writable
    assert [e["name"] for e in container["env"]].count("TANDEM_ENGINE__KIND") == 1  # replaced, not added
    assert env["TANDEM_ENGINE__URL"] == "http://127.0.0.1:30000"  # vLLM's dev routes stay inside the pod
    assert {k: v for k, v in container.items() if k not in ("image", "env")} == {
        k: v for k, v in sglang.items() if k not in ("image", "env")}
    assert (ROOT / compose["build"]["dockerfile"].replace("${ENGINE:+-}", "-").replace("${ENGINE:-}", "vllm")).is_file()


def test_images_are_compose_images(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    images = {c["image"] for _, spec in pod_specs(docs) for c in spec["containers"] + spec.get("initContainers", [])}
    assert images <= set(COMPOSE_IMAGES[overlay].values()), images
    compose = compose_file("compose.cpu.yaml" if overlay == "cpu" else "compose.yaml")
    for base_name, image in COMPOSE_IMAGES[overlay].items():
        if base_name == "tandem-router":
            compose_image = compose_file("compose.replicas.yaml")["services"]["router"]["image"]
        elif base_name == "tandem-inference-cpu":
            compose_image = compose_file("compose.yaml")["services"]["tinker"]["image"]
        elif base_name == "tandem-redis" and overlay == "gpu":
            continue  # compose.yaml takes redis from a registry where one is reachable; the CPU stack builds it
        else:
            compose_image = compose["services"][base_name.removeprefix("tandem-")]["image"]
        assert compose_image_named(compose_image) == image, (overlay, base_name, compose_image)


def compose_image_named(image: str, engine: str = "") -> str:
    """A compose image with no .env: no digest, no prefix, tag dev, `ENGINE` as given (unset: SGLang's image)."""
    # `${TANDEM_<IMAGE>_IMAGE:-<prefix><name>:<tag>}`: a digest from images.env, else prefix and tag
    image = re.sub(r"^\$\{TANDEM_[A-Z_]+_IMAGE:-(.*)\}$", r"\1", image)
    image = image.replace("${TANDEM_IMAGE_PREFIX:-}", "").replace("${TANDEM_TAG:-dev}", "dev")
    return image.replace("${ENGINE:+-}", "-" if engine else "").replace("${ENGINE:-}", engine)


def test_environment_agrees_with_compose(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    inference = env_of(find(docs, "StatefulSet", "inference")["spec"]["template"]["spec"]["containers"][0])
    trainer = env_of(find(docs, "Deployment", "trainer")["spec"]["template"]["spec"]["containers"][0])
    assert inference["TANDEM_STORE__ROOT"] == trainer["TANDEM_STORE__ROOT"] == "/adapters"
    assert inference["TANDEM_REDIS__URL"] == "redis://tandem-inference:$(REDIS_INFERENCE_PASSWORD)@redis:6379/0"
    assert trainer["TANDEM_REDIS__URL"] == "redis://tandem-trainer:$(REDIS_TRAINER_PASSWORD)@redis:6379/0"
    assert inference["TANDEM_ENGINE__URL"] == "http://127.0.0.1:30000"  # the engine on the pod's loopback
    assert inference["TANDEM_REPLICA__ID"] == "$(POD_NAME)"
    assert trainer["TANDEM_WORKER_NAME"] == "trainer"
    if overlay == "cpu":
        assert (
            inference["TANDEM_GPUS__MODE"],
            inference["TANDEM_ENGINE__KIND"],
            inference["TANDEM_ENGINE__LAUNCH"],
            inference["TANDEM_ENGINE__MODEL"],
        ) == ("cpu", "transformers", "true", "/models/tiny")
        assert (trainer["TANDEM_GPUS__MODE"], trainer["TANDEM_BACKEND__KIND"]) == ("cpu", "peft")
    else:
        assert (inference["TANDEM_GPUS__MODE"], inference["TANDEM_ENGINE__KIND"]) == ("split", "sglang")
        compose = compose_file("compose.yaml")["services"]
        assert compose_default(compose["inference"]["environment"]["TANDEM_ENGINE__KIND"]) == "sglang"
        assert compose["trainer"]["environment"]["TANDEM_WORKER_NAME"] == "trainer"


#: compose files whose settings each overlay's pods carry (later files override earlier ones)
COMPOSE_STACKS = {
    "gpu": ("compose.yaml", "compose.replicas.yaml"),
    "cpu": ("compose.yaml", "compose.cpu.yaml", "compose.replicas.yaml", "compose.replicas-cpu.yaml"),
}
#: compose settings set otherwise on Kubernetes, and why
KUBERNETES_ONLY = {
    "HF_HOME": "/models/huggingface",  # the hub cache lives on the models volume
    "TANDEM_GATEWAY__PUBLISHED_HOST": None,  # the router reaches the port beyond loopback: the key is required
    # shared mode's settings: Kubernetes offers split mode only (two pods cannot share one GPU)
    "TANDEM_GPUS__RELEASE_TAGS": None,
    "TANDEM_GPUS__SERVE_WHILE_TRAINING": None,
}


def compose_environment(overlay: str, service: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for name in COMPOSE_STACKS[overlay]:
        env |= compose_file(name)["services"].get(service, {}).get("environment") or {}
    return env


def compose_default(value: str) -> str:
    """A compose value as it reads with no .env: `${X:-d}` is d; a required `${X:?...}` is Kubernetes' `$(X)`."""
    value = re.sub(r"\$\{(\w+):\?[^}]*\}", r"$(\1)", value)
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


@pytest.mark.parametrize(("kind", "service"), [("StatefulSet", "inference"), ("Deployment", "trainer")])
def test_every_compose_setting_is_set_alike(rendered: tuple[str, list[dict[str, Any]]], kind: str, service: str) -> None:
    overlay, docs = rendered
    env = env_of(find(docs, kind, service)["spec"]["template"]["spec"]["containers"][0])
    differing = []
    for name, value in compose_environment(overlay, service).items():
        if name in KUBERNETES_ONLY:
            alike = env.get(name) == KUBERNETES_ONLY[name]
        elif isinstance(env.get(name), dict):  # from the Secret: compose takes it from .env
            alike = "secretKeyRef" in env[name] and "${" in value
        else:
            alike = env.get(name, "<unset>") == compose_default(value)
        if not alike:
            differing.append(f"{name}: compose {value!r}, Kubernetes {env.get(name, '<unset>')!r}")
    assert not differing, (overlay, service, differing)


def test_the_engine_listens_on_the_pods_loopback(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """The engine's admin routes stay inside the pod, whatever the image's default (the CPU image's
    transformers engine binds 0.0.0.0 for compose's separate engine service)."""
    overlay, docs = rendered
    [container] = find(docs, "StatefulSet", "inference")["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    assert (env.get("TANDEM_ENGINE__HOST"), env["TANDEM_ENGINE__URL"]) == ("127.0.0.1", "http://127.0.0.1:30000"), overlay
    assert [p["containerPort"] for p in container["ports"]] == [8000]


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
    from tandem.settings import TrainerSettings

    [trainer] = find(docs, "Deployment", "trainer")["spec"]["template"]["spec"]["containers"]
    live = trainer["livenessProbe"]
    # not killed while it rides out a Redis outage (its probe needs Redis)
    assert live["periodSeconds"] * live["failureThreshold"] > TrainerSettings.model_fields["redis_outage_s"].default


def test_trainer_nodes_are_not_restarted_while_they_wait_for_each_other() -> None:
    from tandem.settings import ParallelSettings

    [container] = find(render("gpu-trainer-nodes"), "StatefulSet", "trainer")["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]
    assert startup["exec"]["command"]  # the base's probe, its threshold raised
    wait = ParallelSettings.model_fields["rendezvous_timeout_s"].default
    assert startup["periodSeconds"] * startup["failureThreshold"] > wait


def test_the_trainer_is_healthy_exactly_while_its_liveness_key_is_in_redis(
    rendered: tuple[str, list[dict[str, Any]]],
    redis_conn: Any,
    redis_url: str,
) -> None:
    """Each trainer probe runs as written in the manifest, against a real Redis: it fails until the
    worker's liveness key is there, whatever the image's environment holds."""
    from tandem import keys

    overlay, docs = rendered
    [container] = find(docs, "Deployment", "trainer")["spec"]["template"]["spec"]["containers"]
    env = {name: value for name, value in env_of(container).items() if isinstance(value, str)}
    env |= {"TANDEM_REDIS__URL": redis_url, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def probe(kind: str) -> int:
        command = container[kind]["exec"]["command"]
        return subprocess.run(command, env=env, capture_output=True, timeout=60).returncode

    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe(kind) != 0, (overlay, kind, "healthy with no trainer alive")
    redis_conn.set(keys.trainer_alive(env["TANDEM_WORKER_NAME"]), "token", ex=30)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe(kind) == 0, (overlay, kind)


#: The Redis user each container's URL names (tandem.acl), and the key of the Secret its password comes from.
REDIS_USERS = {"inference": "tandem-inference", "trainer": "tandem-trainer", "toy-task": "tandem-client",
               "tinker": "tandem-tinker", "rq-dashboard": ""}


def test_each_service_has_its_own_redis_role_and_the_engine_none(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """Each container gets its role's Redis user and password; only the operator's tool, rq-dashboard, the
    admin's (Redis's `default`); the redis pod defines every role's user with tandem.acl's rules."""
    from tandem.acl import USERS, Role, rules

    overlay, docs = rendered
    seen = set()
    for _, spec in pod_specs(docs):
        for container in spec.get("initContainers", []) + spec["containers"]:
            env = env_of(container)
            url = env.get("TANDEM_REDIS__URL") or env.get("RQ_DASHBOARD_REDIS_URL")
            if container["name"] == "redis" or url is None:
                assert "TANDEM_REDIS__URL" not in env, container["name"]
                continue
            user = REDIS_USERS[container["name"]]
            variable = f"REDIS_{user.removeprefix('tandem-').upper()}_PASSWORD" if user else "REDIS_PASSWORD"
            assert url == f"redis://{user}:$({variable})@redis:6379/0", (overlay, container["name"], url)
            key = f"redis-{user.removeprefix('tandem-')}-password" if user else "redis-password"
            assert env[variable]["secretKeyRef"] == {"name": "tandem-secrets", "key": key}, container["name"]
            admin = [name for name, value in env.items()
                     if isinstance(value, dict) and value.get("secretKeyRef", {}).get("key") == "redis-password"]
            assert admin == ([] if user else ["REDIS_PASSWORD"]), (container["name"], admin)
            seen.add(container["name"])
    assert {"inference", "trainer"} <= seen and ("toy-task" in seen) == any(
        d["kind"] == "Job" and d["metadata"]["name"] == "toy-task" for d in docs), seen
    redis = find(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"][0]
    script, env = redis["args"][0], env_of(redis)
    for role in Role:
        variable = f"REDIS_{role.value.upper()}_PASSWORD"
        assert f"\nuser {USERS[role]} reset on >${variable} {rules(role)}\n" in script, role
        assert env[variable]["secretKeyRef"] == {"name": "tandem-secrets", "key": f"redis-{role.value}-password"}
    assert "\nrequirepass $REDIS_PASSWORD\n" in script


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
        return [
            rule
            for spec in policies.values()
            if spec["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") == component
            for rule in spec.get("ingress", [])
        ]

    redis_from = {
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for rule in allowed_from("redis")
        for peer in rule["from"]
    }
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert redis_from == {"inference", "trainer", "client"} | ({"rq-dashboard", "tinker"} & deployments)
    assert not allowed_from("rq-dashboard")  # reached only through `kubectl port-forward`
    if "tinker" in deployments:  # from anywhere, as the router, on its port only (the gateway's key guards it)
        assert [{"ports": [{"port": 8100, "protocol": "TCP"}]}] == allowed_from("tinker")
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


def test_the_toy_task_job_reads_a_hub_models_tokenizer(tmp_path: Path) -> None:
    """The gpu overlay's Job (its toy-task component enabled) names a hub model: its digit tokens come
    from the hub's tokenizer.json, cached on a volume the Job can write, before it calls the stack."""
    spec = find(render("gpu", components=True), "Job", "toy-task")["spec"]["template"]["spec"]
    [container] = spec["containers"]
    env = {name: value for name, value in env_of(container).items() if isinstance(value, str)}
    model = env["TOY_MODEL"]
    assert "/" in model and not model.startswith(("/", ".")), model  # a hub id
    cache = next(m for m in container["volumeMounts"] if env["HF_HOME"].startswith(m["mountPath"] + "/"))
    assert not cache.get("readOnly"), cache  # the tokenizer is downloaded there

    snapshot = tmp_path / "hub" / f"models--{model.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"0": 15, "1": 16, "a": 64}}}))
    (tmp_path / "hub" / f"models--{model.replace('/', '--')}" / "refs").mkdir()
    (tmp_path / "hub" / f"models--{model.replace('/', '--')}" / "refs" / "main").write_text("0" * 40)
    nowhere = "127.0.0.1:9"  # nothing listens: the Job stops at its first call to the stack
    env |= {
        "HF_HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "TANDEM_GATEWAY_URL": f"http://{nowhere}",
        "TANDEM_REDIS__URL": f"redis://{nowhere}/0",
        "PATH": os.environ["PATH"],
    }
    ran = subprocess.run(
        [sys.executable, *container["command"][1:], *container["args"]],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"2 digit tokens in {model}" in ran.stdout, ran.stdout + ran.stderr
    assert ran.returncode != 0


def test_the_dashboard_and_the_toy_task_are_opt_in_and_add_only_themselves() -> None:
    """Neither runs unless its component is enabled; the toy task then runs the overlay's trainer image,
    on the overlay's model (the cpu overlay's tiny model, from its patch that selects the Job by name)."""
    for overlay in OVERLAYS:
        plain, with_components = render(overlay), render(overlay, components=True)
        assert not [d for d in plain if "rq-dashboard" in d["metadata"]["name"] or "tinker" in d["metadata"]["name"]
                    or d["metadata"]["name"] == "toy-task"]
        added = [d for d in with_components if d not in plain]
        assert sorted((d["kind"], d["metadata"]["name"]) for d in added) == [
            ("Deployment", "rq-dashboard"),
            ("Deployment", "tinker"),
            ("Job", "toy-task"),
            ("NetworkPolicy", "redis-from-rq-dashboard"),
            ("NetworkPolicy", "redis-from-tinker"),
            ("NetworkPolicy", "tinker-from-anywhere"),
            ("Service", "tinker"),
        ]
        assert len(with_components) == len(plain) + len(added)
        [toy] = find(with_components, "Job", "toy-task")["spec"]["template"]["spec"]["containers"]
        assert toy["image"] == COMPOSE_IMAGES[overlay]["tandem-trainer"]
        [inference] = find(plain, "StatefulSet", "inference")["spec"]["template"]["spec"]["containers"]
        assert env_of(toy)["TOY_MODEL"] == env_of(inference)["TANDEM_ENGINE__MODEL"]  # the model the engine serves
        assert [e["name"] for e in toy["env"]].count("TOY_MODEL") == 1  # replaced, not added


def test_the_tinker_component_serves_one_port_with_the_gateways_key_as_compose_does() -> None:
    """components/tinker: the `tinker` Service on 8100, as the gateway's `gateway` Service on 8000; the
    pod samples through that Service with the gateway's key, and its settings are compose's `tinker`
    service's but for the gateway's address and the published host (Kubernetes reaches the port from
    anywhere: the key is required)."""
    compose = compose_file("compose.yaml")["services"]["tinker"]["environment"]
    for overlay in OVERLAYS:
        docs = render(overlay, components=True)
        service = find(docs, "Service", "tinker")["spec"]
        assert service["ports"] == [{"name": "tinker", "port": 8100, "targetPort": 8100}]
        assert service["selector"] == {"app.kubernetes.io/component": "tinker"}
        assert find(docs, "Service", "gateway")["spec"]["ports"][0]["port"] == 8000
        [container] = find(docs, "Deployment", "tinker")["spec"]["template"]["spec"]["containers"]
        assert container["command"] == compose_file("compose.yaml")["services"]["tinker"]["command"]
        assert [p["containerPort"] for p in container["ports"]] == [8100]
        assert container["readinessProbe"]["httpGet"]["path"] == "/api/v1/healthz"
        env = env_of(container)
        assert env["TANDEM_TINKER__GATEWAY_URL"] == "http://gateway:8000"
        assert env["TANDEM_GATEWAY__API_KEY"]["secretKeyRef"] == {"name": "tandem-secrets", "key": "gateway-api-key"}
        for name, value in compose.items():
            if name in ("TANDEM_TINKER__GATEWAY_URL", "TANDEM_TINKER__PUBLISHED_HOST"):
                assert name != "TANDEM_TINKER__PUBLISHED_HOST" or name not in env
            elif isinstance(env.get(name), dict):
                assert "secretKeyRef" in env[name] and "${" in value, name
            else:
                assert env.get(name, "<unset>") == compose_default(value), (overlay, name)


def test_every_container_requests_and_limits_memory(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """A platform team's admission rules (checkov CKV_K8S_12/13): no container without a memory
    request and a limit at or above it; init containers too."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

    def parse_quantity(q: str) -> int:
        return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)

    missing = []
    for name, pod in pod_specs(rendered[1]):
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            resources = container.get("resources", {})
            request = resources.get("requests", {}).get("memory")
            limit = resources.get("limits", {}).get("memory")
            if request is None or limit is None or parse_quantity(limit) < parse_quantity(request):
                missing.append(f"{name}/{container['name']}: request {request}, limit {limit}")
    assert missing == []


def test_a_trainer_of_several_nodes_is_a_stateful_set_that_meets_at_its_headless_service(tmp_path: Path) -> None:
    docs = render("gpu-trainer-nodes")
    path = tmp_path / "gpu-trainer-nodes.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "trainer"]
    trainer = find(docs, "StatefulSet", "trainer")
    service = find(docs, "Service", trainer["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == trainer["spec"]["selector"]["matchLabels"]
    [container] = trainer["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    nodes = trainer["spec"]["replicas"]
    assert nodes > 1 and env["TANDEM_PARALLEL__NODES"] == str(nodes)
    host, port = env["TANDEM_PARALLEL__RENDEZVOUS_ENDPOINT"].split(":")
    assert host == f"trainer-0.{service['metadata']['name']}"  # the StatefulSet's first pod
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    assert env["TANDEM_PARALLEL__NODE_ADDRESS"] == f"$(POD_NAME).{service['metadata']['name']}"
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_NAME") < names.index("TANDEM_PARALLEL__NODE_ADDRESS")  # defined before it is used
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert env["TANDEM_PARALLEL__RANKS"] == str(gpus)
    from tandem.settings import ParallelSettings

    ParallelSettings(nodes=nodes, ranks=gpus, rendezvous_endpoint=env["TANDEM_PARALLEL__RENDEZVOUS_ENDPOINT"],
                     node_address=f"trainer-1.{service['metadata']['name']}")  # values the trainer accepts
    # the ranks reach each other (every port: store, gloo and NCCL take free ones) and nothing else does
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy"
                and d["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") == "trainer"]
    assert policies == [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "trainer"}},
                         "policyTypes": ["Ingress"],
                         "ingress": [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "trainer"}}}]}]}]
    assert find(docs, "PersistentVolumeClaim", "adapters")["spec"]["accessModes"] == ["ReadWriteMany"]  # rank 0 on any pod
    gpu = render("gpu")
    ours = {("Service", "trainer-ranks"), ("NetworkPolicy", "trainer-from-trainer"), ("StatefulSet", "trainer")}
    assert [d for d in docs if (d["kind"], d["metadata"]["name"]) not in ours] == [
        d for d in gpu if (d["kind"], d["metadata"]["name"]) != ("Deployment", "trainer")]
    for check in (test_nothing_runs_as_root, test_no_secret_is_inline, test_every_container_requests_and_limits_memory):
        check(("gpu", docs))


@pytest.mark.parametrize("overlay", sorted(p.name for p in (ROOT / "deploy" / "k8s" / "overlays").iterdir()))
def test_every_object_of_every_overlay_lies_in_tandems_namespace(overlay: str) -> None:
    """Not in whatever namespace kubectl happens to use: there `trainer-0.trainer-ranks` would not
    resolve and the namespace's policies would not let the ranks meet."""
    cluster_wide = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
    for docs in (render(overlay), *([render(overlay, components=True)] if overlay in OVERLAYS else [])):
        astray = [(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in docs
                  if d["kind"] not in cluster_wide and d["metadata"].get("namespace") != "tandem"]
        assert not astray, (overlay, astray)


# the Prometheus Operator component ----------------------------------------------------------------
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_monitoring_component_scrapes_real_ports_with_the_stacks_alerts(overlay: str, tmp_path: Path) -> None:
    """Its PodMonitors select pods that exist and name ports those pods have, scrape the compose
    Prometheus' jobs on their paths (the engine's relayed by the gateway), the NetworkPolicy lets the
    scrapes in, and its PrometheusRule is images/prometheus/alerts.yml (the operator's custom resources
    have no schema here: the rest is validated strictly)."""
    scratch = tmp_path / "with-monitoring"
    scratch.mkdir()
    k8s = ROOT / "deploy" / "k8s"
    (scratch / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(k8s / "overlays" / overlay, scratch)],
        "components": [os.path.relpath(k8s / "components" / "monitoring", scratch)],
    }))
    out = subprocess.run([tool("kubectl"), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(scratch)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    custom = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump_all([d for d in docs if d not in custom]))
    checked = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, str(plain)],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    monitors = [d for d in custom if d["kind"] == "PodMonitor"]
    paths = {e["relabelings"][0]["replacement"]: e["path"] for m in monitors for e in m["spec"]["podMetricsEndpoints"]}
    compose_jobs = yaml.safe_load((ROOT / "images" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    assert paths == {j["job_name"]: j.get("metrics_path", "/metrics") for j in compose_jobs}  # the same jobs and paths
    assert paths == {"gateway": "/metrics", "engine": "/metrics/engine", "trainer": "/metrics"}
    policy = find(docs, "NetworkPolicy", "metrics-from-monitoring")
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    for monitor in monitors:
        wanted = monitor["spec"]["selector"]["matchLabels"]
        pods = [spec for d in docs if d["kind"] in WORKLOADS
                for spec in [d["spec"]["template"]] if wanted.items() <= spec["metadata"]["labels"].items()]
        assert pods, f"{monitor['metadata']['name']} selects no pod"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            ports = {p["name"]: p["containerPort"] for pod in pods for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            assert endpoint["port"] in ports, (monitor["metadata"]["name"], endpoint["port"], ports)
            assert ports[endpoint["port"]] in allowed
    [rule] = [d for d in custom if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load((ROOT / "images" / "prometheus" / "alerts.yml").read_text())
