"""Each service is given its own role's Redis URL (tandem.acl), and the engines none: in `tandem up`'s
composition, in the compose files, and in the engine the inference service launches. The redis
service defines every role's user with tandem.acl's rules. (Kubernetes: test_k8s_manifests.py.)
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from helpers.compose_yaml import services

from tandem.acl import ADMIN, USERS, Role, role_url, rules, user_line, without_credentials
from tandem.dev.composition import Composition, StackConfig
from tandem.dev.credentials import load_secrets
from tandem.settings import InferenceSettings
from tandem_inference.engines import own_engine
from tandem_inference.engines.launcher import engine_env

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def role_of(url: str) -> str:
    """The Redis user a compose URL names, and the .env variable of its password."""
    found = re.fullmatch(r"redis://([\w-]*):\$\{(\w+):\?[^}]*\}@redis:6379/0", url)
    assert found, url
    return f"{found[1]} {found[2]}"


@pytest.mark.parametrize(("file", "service", "user"), [
    ("compose.yaml", "inference", "tandem-inference REDIS_INFERENCE_PASSWORD"),
    ("compose.yaml", "trainer", "tandem-trainer REDIS_TRAINER_PASSWORD"),
    ("compose.yaml", "tinker", "tandem-tinker REDIS_TINKER_PASSWORD"),
    ("compose.trainer-nodes.yaml", "trainer-peer", "tandem-trainer REDIS_TRAINER_PASSWORD"),
])
def test_each_compose_service_gets_its_roles_url(file: str, service: str, user: str) -> None:
    assert role_of(services(file)[service]["environment"]["TANDEM_REDIS__URL"]) == user


def test_no_compose_service_inherits_a_redis_url_and_the_engine_has_none() -> None:
    shared = yaml.safe_load((ROOT / "compose.yaml").read_text())["x-tandem-env"]
    assert "TANDEM_REDIS__URL" not in shared
    assert "TANDEM_REDIS__URL" not in (services("compose.cpu.yaml")["engine"].get("environment") or {})
    for file in sorted(ROOT.glob("compose*.yaml")):
        for name, service in services(file.name).items():
            url = ((service or {}).get("environment") or {}).get("TANDEM_REDIS__URL")
            assert url is None or not url.startswith("redis://:"), f"{file.name} gives {name} the admin's URL"


def test_rq_dashboard_an_operators_tool_uses_the_admins_url() -> None:
    url = services("compose.yaml")["rq-dashboard"]["environment"]["RQ_DASHBOARD_REDIS_URL"]
    assert role_of(url) == " REDIS_PASSWORD"


def test_compose_redis_defines_every_roles_user_with_its_rules() -> None:
    redis = services("compose.yaml")["redis"]
    script = redis["entrypoint"][2]
    for role in Role:
        variable = f"REDIS_{role.value.upper()}_PASSWORD"
        assert f"\nuser {USERS[role]} reset on >$${variable} {rules(role)}\n" in script, role
        assert redis["environment"][variable].startswith(f"${{{variable}:?set {variable} in .env")
        assert "make .env" in redis["environment"][variable]  # what to do with an older .env
    assert "\nrequirepass $$REDIS_PASSWORD\n" in script


def test_tandem_ups_services_each_get_their_roles_url_and_the_engine_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_REDIS__URL", "redis://:from-the-shell@127.0.0.1:1/0")
    monkeypatch.setenv("TANDEM_REDIS__PASSWORD", "from-the-shell")
    stack = Composition(StackConfig(state_dir=tmp_path, gateway_port=0, redis_port=0))
    if not stack.roles:
        pytest.skip("this redis-server is older than 7.0: the stack's services share the admin's user")
    env = stack.env()
    got = {svc.name: {**env, **svc.env}.get("TANDEM_REDIS__URL") for svc in stack.plan()}
    port = stack.redis_port
    secrets = stack.secrets
    assert got == {
        "redis": None,
        "engine": None,
        "inference": f"redis://tandem-inference:{secrets['redis_inference_password']}@127.0.0.1:{port}/0",
        "trainer": f"redis://tandem-trainer:{secrets['redis_trainer_password']}@127.0.0.1:{port}/0",
        **({"tinker": f"redis://tandem-tinker:{secrets['redis_tinker_password']}@127.0.0.1:{port}/0"}
           if stack.tinker_url else {}),
    }
    assert "TANDEM_REDIS__PASSWORD" not in env
    assert stack.redis_url == f"redis://tandem-client:{secrets['redis_client_password']}@127.0.0.1:{port}/0"
    assert stack.admin_redis_url == f"redis://:{secrets['redis_password']}@127.0.0.1:{port}/0"
    assert f"TANDEM_REDIS__URL={stack.redis_url}\n" in stack.write_client_env().read_text()
    conf = stack._redis_conf().read_text().splitlines()
    assert f"requirepass {secrets['redis_password']}" in conf
    for role in Role:
        assert user_line(role, secrets[f"redis_{role}_password"]) in conf


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="several replicas need the router, HAProxy, to plan")
def test_the_replicas_engines_get_no_redis_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_REDIS__URL", "redis://:from-the-shell@127.0.0.1:1/0")
    stack = Composition(StackConfig(state_dir=tmp_path, gateway_port=0, redis_port=0, replicas=2))
    env = stack.env()
    plan = {svc.name: {**env, **svc.env} for svc in stack.plan() if svc.name != "router"}
    tinker = {"tinker"} if stack.tinker_url else set()
    assert {name for name, e in plan.items() if "TANDEM_REDIS__URL" in e} == {"inference-1", "inference-2", "trainer",
                                                                             *tinker}
    assert plan["inference-1"]["TANDEM_REDIS__URL"] == stack.redis_urls[Role.INFERENCE]


def test_a_stack_on_a_given_redis_gives_every_service_that_url(tmp_path: Path) -> None:
    url = "redis://ops:pw@10.0.0.1:6379/2"
    stack = Composition(StackConfig(state_dir=tmp_path, gateway_port=0, redis_url=url))
    assert not stack.roles and stack.redis_url == stack.admin_redis_url == url
    assert set(stack.redis_urls.values()) == {url}


def test_older_secrets_keep_their_passwords_and_gain_the_roles(tmp_path: Path) -> None:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps({"redis_password": "kept", "engine_admin_key": "key"}))
    path.chmod(0o600)
    made = load_secrets(path)
    assert made["redis_password"] == "kept" and made["engine_admin_key"] == "key"
    assert all(len(made[f"redis_{role}_password"]) == 32 for role in Role)
    assert load_secrets(path) == made and json.loads(path.read_text()) == made


def test_the_engines_the_inference_service_launches_start_without_its_redis_url() -> None:
    base = {"TANDEM_REDIS__URL": "redis://tandem-inference:pw@redis:6379/0", "TANDEM_REDIS__PASSWORD": "pw",
            "TANDEM_STORE__ROOT": "/adapters"}
    assert engine_env(InferenceSettings(), base) == {"TANDEM_STORE__ROOT": "/adapters"}
    assert without_credentials(base) == {"TANDEM_STORE__ROOT": "/adapters"}


def test_the_transformers_engine_a_replica_launches_gets_no_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_REDIS__URL", "redis://tandem-inference:pw@redis:6379/0")
    own = own_engine(InferenceSettings(engine={"kind": "transformers", "launch": True}))
    assert own is not None and "TANDEM_REDIS__URL" not in own.env


def test_a_role_url_names_its_user_and_keeps_host_port_and_database() -> None:
    assert role_url("redis://:old@redis:6379/3", Role.TRAINER, "pw") == "redis://tandem-trainer:pw@redis:6379/3"
    assert role_url("redis://127.0.0.1:1/0", None, "p/w") == "redis://:p%2Fw@127.0.0.1:1/0"
    assert ADMIN == "default"
