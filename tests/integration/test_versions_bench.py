"""bench/suite.py's versions scenario on the CPU stack, quick (4 runs of 3 versions) through 4 engine slots:
every answer is its version's (by its tokens and logprobs against references the same engine computed with
each version alone), no request fails, and the versions did cycle through the slots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 4


def test_twelve_versions_through_four_slots_answer_each_as_its_reference(tiny_model: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "bench/suite.py", "--quick", "--only", "versions", "--engine-slots", str(SLOTS),
         "--model", str(tiny_model), "--out", str(tmp_path / "out")],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "results.json").read_text())["scenarios"]["versions"]
    s = result["summary"]

    assert (s["runs"], s["versions"], s["engine_slots"], s["exceeded"]) == (4, 12, SLOTS, True)
    assert s["references_distinct"] and s["versions_asked"] > SLOTS
    assert (s["failed"], s["wrong"]) == (0, 0), s["failed_examples"] + s["wrong_examples"]
    assert s["logprob_max_diff"] <= s["logprob_tolerance"] == 1e-3
    # every version asked for beyond the slots' worth was loaded on demand during the requests
    assert s["on_demand_loads"] >= s["versions_asked"] - SLOTS
    assert [g["met"] for g in result["goals"]] == [True, True, True]  # no failed, no wrong, all checked
    assert s["requests"] == s["requests_planned"]
    assert "| 4 x 3 | 4 | yes |" in result["table"]
