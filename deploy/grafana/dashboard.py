"""Writes tandem.json, the Grafana dashboard of a tandem stack, from the panels listed here.

    .venv/bin/python deploy/grafana/dashboard.py     # after editing a panel; tests/unit/test_dashboard.py
                                                     # checks that tandem.json is current and that every
                                                     # query names metrics the services export

Five rows: the loop (reward, versions published and served, step → served, staleness),
serving (requests, latency, 429s, queue), the engine (each replica's SGLang, vLLM or
transformers engine, as its gateway relays it on /metrics/engine: requests running and queued,
KV-cache usage, tokens/s), training (step time, loss, KL, entropy, gradient norm, tokens/s,
jobs, queue) and health (replicas up and in step, engines answering, the trainer's last step,
malformed events). An engine panel queries each engine's names; only the one that runs has
data. Import it in Grafana with a Prometheus data source that scrapes the stack (compose's
`metrics` profile, or a Prometheus of your own).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: (row, [(title, unit, [(query, legend)]), ...]); units are Grafana's.
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("The loop", [
        ("Reward (mean of each step's rollouts)", "none", [
            ("tandem_trainer_reward_mean", "{{run}} mean"), ("tandem_trainer_reward_std", "{{run}} std")]),
        ("Versions: published by the trainer, served by each replica", "none", [
            ("tandem_trainer_published_version", "{{run}} published"),
            ("tandem_serving_version", "{{run}} serving ({{instance}})")]),
        ("adapter_ready → serving (p50, p90)", "s", [
            ("histogram_quantile(0.5, sum by (le) (rate(tandem_adapter_ready_to_serving_seconds_bucket[5m])))", "p50"),
            ("histogram_quantile(0.9, sum by (le) (rate(tandem_adapter_ready_to_serving_seconds_bucket[5m])))", "p90")]),
        ("Staleness of the rollouts (versions behind)", "none", [
            ("tandem_trainer_rollout_staleness_steps", "{{run}}")]),
    ]),
    ("Serving", [
        ("Requests by status", "reqps", [
            ("sum by (status) (rate(tandem_gateway_requests_total[1m]))", "{{status}}")]),
        ("Latency (p50, p95)", "s", [
            ("histogram_quantile(0.5, sum by (le) (rate(tandem_gateway_request_seconds_bucket[5m])))", "p50"),
            ("histogram_quantile(0.95, sum by (le) (rate(tandem_gateway_request_seconds_bucket[5m])))", "p95")]),
        ("Refused with 429", "reqps", [
            ("sum by (reason) (rate(tandem_gateway_refused_total[1m]))", "{{reason}}")]),
        ("Queue and work in flight", "none", [
            ("sum(tandem_gateway_queued_requests)", "queued"), ("sum(tandem_gateway_in_flight)", "in flight"),
            ("sum(tandem_gateway_in_flight_sequences)", "sequences")]),
        ("Adapter loads and rejections", "ops", [
            ("sum(rate(tandem_adapter_loads_total[5m]))", "loads"),
            ("sum(rate(tandem_adapter_rejections_total[5m]))", "rejections"),
            ("sum(rate(tandem_adapter_load_timeouts_total[5m]))", "timeouts")]),
    ]),
    ("Engine", [
        ("Requests running and queued in each engine", "none", [
            ("sum by (instance) (sglang:num_running_reqs)", "{{instance}} running"),
            ("sum by (instance) (sglang:num_queue_reqs)", "{{instance}} queued"),
            ("sum by (instance) (vllm:num_requests_running)", "{{instance}} running"),
            ("sum by (instance) (vllm:num_requests_waiting)", "{{instance}} queued")]),
        ("KV-cache usage", "percentunit", [
            ("max by (instance) (sglang:token_usage)", "{{instance}}"),
            ("max by (instance) (vllm:kv_cache_usage_perc)", "{{instance}}")]),
        ("Engine tokens per second, prompt and generated", "none", [
            ("sum by (instance) (rate(sglang:prompt_tokens_total[1m]))", "{{instance}} prompt"),
            ("sum by (instance) (rate(sglang:generation_tokens_total[1m]))", "{{instance}} generated"),
            ("sum by (instance) (rate(vllm:prompt_tokens_total[1m]))", "{{instance}} prompt"),
            ("sum by (instance) (rate(vllm:generation_tokens_total[1m]))", "{{instance}} generated"),
            ("sum by (instance) (rate(tandem_engine_prompt_tokens_total[1m]))", "{{instance}} prompt"),
            ("sum by (instance) (rate(tandem_engine_generated_tokens_total[1m]))", "{{instance}} generated")]),
    ]),
    ("Training", [
        ("Step time by stage (mean over 5 min)", "s", [
            ("sum by (stage) (rate(tandem_trainer_stage_seconds_sum[5m])) / "
             "sum by (stage) (rate(tandem_trainer_stage_seconds_count[5m]))", "{{stage}}")]),
        ("Loss", "none", [("tandem_trainer_loss", "{{run}}")]),
        ("KL (k3, per token)", "none", [("tandem_trainer_kl", "{{run}} to {{against}}")]),
        ("Entropy and clip fraction", "none", [
            ("tandem_trainer_entropy", "{{run}} entropy"), ("tandem_trainer_clip_fraction", "{{run}} clipped")]),
        ("Gradient norm", "none", [("tandem_trainer_grad_norm", "{{run}}")]),
        ("Trained tokens per second", "none", [("tandem_trainer_tokens_per_second", "{{run}}")]),
        ("Jobs by outcome, queue depth", "none", [
            ("sum by (outcome) (increase(tandem_trainer_jobs_total[10m]))", "{{outcome}} (10 min)"),
            ("tandem_trainer_queue_depth", "queued")]),
        ("GPU lease wait (shared mode, mean over 5 min)", "s", [
            ("rate(tandem_trainer_gpu_lease_wait_seconds_sum[5m]) / "
             "rate(tandem_trainer_gpu_lease_wait_seconds_count[5m])", "wait")]),
    ]),
    ("Health", [
        ("Inference replicas: answering, engines answering, serving each run", "none", [
            ('sum(up{job="gateway"})', "answering"), ('sum(up{job="engine"})', "engines answering"),
            ("count by (run) (tandem_serving_version)", "{{run}}")]),
        ("Replicas behind the newest serving version", "none", [
            ("max by (run) (tandem_serving_version) - on(run) group_right() tandem_serving_version",
             "{{run}} {{instance}}")]),
        ("Seconds since the trainer's last step", "s", [
            ("time() - tandem_trainer_last_step_timestamp_seconds", "since last step")]),
        ("Controller: malformed events, ignored claims", "none", [
            ("increase(tandem_controller_malformed_events_total[10m])", "malformed (10 min)"),
            ("increase(tandem_replica_claims_ignored_total[10m])", "ignored claims (10 min)")]),
    ]),
]

PANEL_W, PANEL_H = 8, 8


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, next_id = 0, 1
    source = {"type": "prometheus", "uid": "${datasource}"}
    for row, row_panels in ROWS:
        panels.append({"id": next_id, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y = next_id + 1, y + 1
        for i, (title, unit, queries) in enumerate(row_panels):
            panels.append({
                "id": next_id, "type": "timeseries", "title": title, "datasource": source,
                "gridPos": {"h": PANEL_H, "w": PANEL_W, "x": (i % 3) * PANEL_W, "y": y + (i // 3) * PANEL_H},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"datasource": source, "expr": expr, "legendFormat": legend, "refId": chr(65 + k)}
                            for k, (expr, legend) in enumerate(queries)],
            })
            next_id += 1
        y += ((len(row_panels) + 2) // 3) * PANEL_H
    return {
        "title": "tandem", "uid": "tandem-stack", "schemaVersion": 39, "version": 1, "editable": True,
        "tags": ["tandem"], "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus"}]},
        "panels": panels,
    }


def rendered() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    (Path(__file__).parent / "tandem.json").write_text(rendered())
