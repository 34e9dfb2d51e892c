"""bench/hotload/hotload_report.py: the hot-load report from given rows: p50s, ratios, the goal, failures named."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.bench import bench_module

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def hotload():
    return bench_module("hotload.hotload_report")


def hot(i: int, load: float, first: float, warmup: bool = False) -> dict:
    return {"approach": "hot-load", "i": i, "warmup": warmup, "load_ms": load, "first_response_ms": first,
            "total_ms": load + first}


def restart(i: int, boot: float) -> dict:
    return {"approach": "restart", "i": i, "stop_ms": 100.0, "boot_ms": boot, "load_ms": 20.0,
            "first_response_ms": 10.0, "total_ms": 130.0 + boot}


def test_p50s_ratios_and_a_missed_goal_said_so(hotload, tmp_path: Path) -> None:
    rows = [hot(0, 500, 10, warmup=True), hot(1, 10, 5), hot(2, 20, 10), hot(3, 30, 10),
            restart(1, 1000), restart(2, 2000),
            {"approach": "merge-reload", "i": 1, "error": "/update_weights_from_disk failed: (400) no"}]
    result = hotload.report(SimpleNamespace(engine="sglang", model="m"), rows, tmp_path)
    summary = result["summary"]
    assert summary["hotload_total_ms_p50"] == 30  # the warm-up is left out
    assert summary["hotload_warmup_total_ms"] == 510
    assert summary["restart_total_ms_p50"] == 1630 and summary["restart_boot_ms_p50"] == 1500
    assert summary["restart_over_hotload"] == pytest.approx(1630 / 30)
    assert summary["merge_total_ms_p50"] is None and summary["merge_over_hotload"] is None
    assert summary["errors"] == ["merge-reload 1: /update_weights_from_disk failed: (400) no"]
    (goal,) = result["goals"]
    assert goal["met"] is False and goal["value"] == pytest.approx(54.3) and goal["target"] == 100
    assert goal["note"] == ""  # SGLang: the goal applies as stated
    assert "| (b) restart | 2 | 1,630 |" in result["table"]
    assert "Not measured: merge-reload 1: /update_weights_from_disk failed" in result["table"]
    assert result["plots"] == ["hotload.png"] and (tmp_path / "hotload.png").is_file()


def test_no_restart_measured_is_a_missed_goal_with_the_reason(hotload, tmp_path: Path) -> None:
    rows = [hot(1, 10, 5), {"approach": "restart", "i": 1, "error": "engine exited while booting"}]
    result = hotload.report(SimpleNamespace(engine="transformers", model="m"), rows, tmp_path)
    (goal,) = result["goals"]
    assert goal["met"] is False and goal["value"] is None
    assert "transformers engine" in goal["note"] and "engine exited while booting" in goal["note"]
