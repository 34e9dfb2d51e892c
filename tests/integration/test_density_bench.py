"""bench/suite.py's density scenario on the CPU stack (quick: 2 steps a run) with one run and then two at once:
every run does all its steps, every version is seen served, and each count's runs are deleted after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_one_run_and_two_at_once_each_do_their_steps_and_are_measured(tiny_model: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "bench/suite.py", "--quick", "--only", "density", "--density-runs", "1,2",
         "--model", str(tiny_model), "--out", str(tmp_path / "out")],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "results.json").read_text())["scenarios"]["density"]

    one, two = result["rows"]
    assert (one["runs"], two["runs"]) == (1, 2)
    for r in (one, two):
        assert [p["steps"] for p in r["per_run"]] == [2] * r["runs"] and not any(p["error"] for p in r["per_run"])
        assert r["versions"] == 2 * r["runs"] and r["served_n"] == r["versions"]  # each version answered a probe
        assert r["deleted"] == r["runs"]
        assert r["rollout_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0 and 0 < r["fairness"] <= 1
    assert one["fairness"] == 1.0 and one["rollout_ratio"] == 1.0 and one["served_p95_ratio"] == 1.0
    assert two["rollout_ratio"] == two["rollout_tokens_per_s"] / one["rollout_tokens_per_s"]
    assert [g["met"] for g in result["goals"]] == [True]  # on the CPU: nothing failed; the targets are the GPU's
    assert "(≥ 0.85)" in result["table"] and (tmp_path / "out" / "density.png").stat().st_size > 0
