"""bench/suite.py called twice on one state directory (`--state`, as the GPU harness does): the second
call measures only what it did itself. A second call once counted the first call's versions in its
sync table (80 rows for 40 versions) and continued the first call's pipeline runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def suite(tiny_model: Path, state: Path, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "bench/suite.py", "--quick", "--only", "sync", "--model", str(tiny_model),
         "--state", str(state), "--out", str(out)],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())["scenarios"]["sync"]


def test_a_second_call_on_the_same_state_measures_only_its_own_versions(tiny_model: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = suite(tiny_model, state, tmp_path / "one")
    second = suite(tiny_model, state, tmp_path / "two")

    assert [r["version"] for r in first["rows"]] == list(range(1, 9))  # quick: 8 versions
    assert [r["version"] for r in second["rows"]] == list(range(9, 17))  # the same run, continued: its own 8
    assert "8 versions" in second["table"]

