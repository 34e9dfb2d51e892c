"""The Grafana dashboard (deploy/grafana/tandem.json) and the alert rules (images/prometheus/alerts.yml)
name only metrics that tandem's services export, and only jobs that Prometheus scrapes: tandem's names
come from the services' own registries, SGLang's and vLLM's (relayed on /metrics/engine) from their
bodies in tests/fixtures/engine-metrics/, the jobs from images/prometheus/prometheus.yml. The rules'
own tests (images/prometheus/alerts.test.yml) run where promtool is."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tandem_inference.controller.metrics import ControllerMetrics
from tandem_inference.engines.transformers.metrics import EngineMetrics
from tandem_inference.gateway.metrics import GatewayMetrics
from tandem_trainer.metrics import TrainerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tandem.json"
ALERTS = ROOT / "images" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "images" / "prometheus" / "alerts.test.yml"
SCRAPES = ROOT / "images" / "prometheus" / "prometheus.yml"
ENGINE_BODIES = ROOT / "tests" / "fixtures" / "engine-metrics"
METRIC = re.compile(r"\b(tandem_[a-z0-9_]+)\b")
ENGINE_METRIC = re.compile(r"\b((?:sglang|vllm):[a-z0-9_:]+)")
JOB = re.compile(r'job="([^"]+)"')


def exported() -> set[str]:
    """Every sample name (counters' `_total`, histograms' `_bucket`/`_sum`/`_count`) the services'
    registries hold; labelled metrics get one child each so that their samples show."""
    registries = [TrainerMetrics().registry, EngineMetrics().registry]
    for metrics_class in (GatewayMetrics, ControllerMetrics):
        registry = CollectorRegistry()
        metrics_class(registry)
        registries.append(registry)
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            for collector in list(registry._collector_to_names):  # noqa: SLF001 - labelled families
                labels = getattr(collector, "_labelnames", ())
                if labels:
                    child = collector.labels(*("x" for _ in labels))  # type: ignore[attr-defined]
                    names.update(s.name for m in child.collect() for s in m.samples)
    return names


def engine_samples() -> set[str]:
    """Every sample name in SGLang's and vLLM's /metrics bodies."""
    return {sample.name for body in ENGINE_BODIES.glob("*.txt")
            for family in text_string_to_metric_families(body.read_text()) for sample in family.samples}


def queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in board["panels"] if panel["type"] != "row"
            for target in panel["targets"]]


def test_every_panel_queries_metrics_the_services_export() -> None:
    names, engines = exported(), engine_samples()
    assert "tandem_trainer_loss" in names and "tandem_gateway_requests_total" in names
    assert "sglang:num_queue_reqs" in engines and "vllm:num_requests_waiting" in engines
    panels = queries()
    assert len(panels) >= 20
    by_panel: dict[str, set[str]] = {}
    for title, expr in panels:
        by_panel.setdefault(title, set()).update(METRIC.findall(expr) + ENGINE_METRIC.findall(expr))
    for title, used in by_panel.items():
        assert used, f"panel {title!r} queries no metric"
        unknown = {n for n in used if n not in names and n not in engines}
        assert not unknown, f"panel {title!r} names metrics no service exports: {sorted(unknown)}"


def test_the_dashboard_covers_the_loop_serving_training_and_health() -> None:
    board = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["The loop", "Serving", "Engine", "Training", "Health"]
    text = " ".join(expr for _, expr in queries())
    for needed in ("tandem_trainer_reward_mean", "tandem_serving_version", "tandem_adapter_ready_to_serving_seconds",
                   "tandem_gateway_requests_total", "tandem_gateway_request_seconds", "tandem_gateway_refused_total",
                   "tandem_gateway_queued_requests", "tandem_trainer_stage_seconds", "tandem_trainer_loss",
                   "tandem_trainer_kl", "tandem_controller_malformed_events_total", 'up{job="gateway"}',
                   "sglang:num_queue_reqs", "sglang:token_usage", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc", "tandem_engine_generated_tokens_total", 'up{job="engine"}'):
        assert needed in text, needed


def test_the_dashboard_file_is_what_its_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("dashboard", DASHBOARD.parent / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.rendered(), "run .venv/bin/python deploy/grafana/dashboard.py"


def test_every_alert_names_metrics_the_services_export() -> None:
    names = exported()
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert {"TandemTrainerStuck", "TandemReplicaOutOfRotation", "TandemSyncSlow"} <= {r["alert"] for r in rules}
    for rule in rules:
        used = set(METRIC.findall(rule["expr"]))
        assert used <= names, f"alert {rule['alert']} names metrics no service exports: {sorted(used - names)}"


def test_every_job_named_is_one_prometheus_scrapes() -> None:
    jobs = {job["job_name"] for job in yaml.safe_load(SCRAPES.read_text())["scrape_configs"]}
    assert jobs == {"gateway", "engine", "trainer"}
    rules = [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    named = {job for expr in [*rules, *(e for _, e in queries())] for job in JOB.findall(expr)}
    assert named and named <= jobs, sorted(named - jobs)


def test_promtool_accepts_the_rules_and_the_scrape_configuration(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool here (Debian's `prometheus` package has it; the image's build runs the same check)")
    config = yaml.safe_load(SCRAPES.read_text())  # its rule file where the image puts it: here, beside it
    config["rule_files"] = [str(ALERTS) for _ in config["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    for args in (["check", "rules", str(ALERTS)], ["check", "config", str(tmp_path / "prometheus.yml")]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_crash_looping_trainer_has_an_alert_its_tests_fire() -> None:
    """The trainer's start time is what TandemTrainerCrashLooping counts; the rule tests name only
    alerts that exist, and show it firing on a crash loop and not on a single restart, while
    TandemTrainerDown and TandemTrainerStuck stay quiet on the loop (why it is needed)."""
    before = time.time()
    value = TrainerMetrics().registry.get_sample_value("tandem_trainer_start_time_seconds")
    assert value is not None and before <= value <= time.time()
    rules = {rule["alert"]: rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}
    assert "tandem_trainer_start_time_seconds" in rules["TandemTrainerCrashLooping"]["expr"]
    assert "changes(" in rules["TandemTrainerCrashLooping"]["expr"]
    suite = yaml.safe_load(ALERT_TESTS.read_text())
    assert suite["rule_files"] == [ALERTS.name]
    checks = [(check["alertname"], bool(check["exp_alerts"])) for test in suite["tests"]
              for check in test["alert_rule_test"]]
    assert {name for name, _ in checks} <= rules.keys()
    assert ("TandemTrainerCrashLooping", True) in checks and ("TandemTrainerCrashLooping", False) in checks
    assert {("TandemTrainerDown", False), ("TandemTrainerStuck", False)} <= set(checks)


def test_promtool_passes_the_rules_tests() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool here (Debian's `prometheus` package has it; the image's build runs the same tests)")
    done = subprocess.run([promtool, "test", "rules", ALERT_TESTS.name], cwd=ALERT_TESTS.parent,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
