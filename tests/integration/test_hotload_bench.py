"""bench/hotload/hotload.py end to end on the tiny model and the transformers engine (quick settings)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.adapters import publish
from helpers.bench import bench_module

from tandem.adapters import AdapterStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "hl"


def test_quick_run_measures_all_three_and_the_merge_changes_the_served_weights(
    tiny_model: Path, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "adapters")
    for version in (1, 2):  # published as the trainer leaves them (nonzero B: each changes outputs)
        publish(store, None, tiny_model, RUN, version, rank=8)
    messages: list[str] = []
    ctx = SimpleNamespace(
        out=tmp_path / "out", quick=True, model=str(tiny_model), engine="transformers",
        tandem_python=sys.executable, sglang_python="python3", vllm_python="python3", engine_env={"TANDEM_LOG_LEVEL": "INFO"},
        store_root=store.root, run_name=RUN, progress=messages.append,
    )
    result = bench_module("hotload.hotload").run(ctx)

    assert {"name", "title", "summary", "rows", "goals", "table", "plots"} <= set(result)
    assert result["name"] == "hotload" and result["plots"] == ["hotload.png"]
    assert (ctx.out / "hotload.png").stat().st_size > 0 and (ctx.out / "hotload-engine.log").is_file()
    rows = result["rows"]
    by = {a: [r for r in rows if r["approach"] == a and not r.get("warmup")] for a in ("hot-load", "restart", "merge-reload")}
    assert [len(by[a]) for a in by] == [2, 1, 1]  # quick: 2 hot-loads, 1 restart, 1 merge
    assert [r["adapter"] for r in by["hot-load"]] == [str(store.adapter_dir(RUN, v)) for v in (1, 2)]
    for r in rows:
        assert "error" not in r, r
        assert r["total_ms"] > 0
    restart, merged = by["restart"][0], by["merge-reload"][0]
    assert restart["boot_ms"] > 0 and restart["stop_ms"] > 0 and restart["same_tokens_as_hotload"] is True
    assert merged["merge_save_ms"] > 0 and merged["reload_ms"] > 0
    # (c) really changed what the base model serves: it now answers like the adapter it merged
    assert merged["base_changed"] is True and merged["matches_adapter"] is True
    assert merged["max_logprob_diff_vs_adapter"] < 1e-3

    summary = result["summary"]
    assert summary["restart_over_hotload"] > 1 and summary["merge_over_hotload"] > 0
    assert summary["merged_changed_served_weights"] is True and summary["merged_answers_like_adapter"] is True
    (goal,) = result["goals"]
    assert goal["name"] == "hot-load ≥ 100× faster than an engine restart" and goal["target"] == 100
    assert goal["value"] == pytest.approx(summary["restart_over_hotload"], abs=0.1)
    assert goal["met"] is (goal["value"] >= 100) and goal["at_most"] is False and "transformers" in goal["note"]
    assert "(a) hot-load" in result["table"] and "(b) restart" in result["table"] and "(c) merge" in result["table"]
    assert any("restart 1/1" in m for m in messages) and any("merge 1/1" in m for m in messages)


def test_without_published_versions_random_adapters_are_made(tiny_model: Path, tmp_path: Path) -> None:
    messages: list[str] = []
    ctx = SimpleNamespace(out=tmp_path, model=str(tiny_model), tandem_python=sys.executable, sglang_python="python3",
                          vllm_python="python3",
                          store_root=tmp_path / "empty-store", run_name=RUN, progress=messages.append)
    made = bench_module("hotload.hotload_adapters").adapters(ctx, 5)

    assert [p.name for p in made] == ["v000001", "v000002"]  # at most two
    assert all((p / "adapter_model.safetensors").is_file() for p in made)
    assert bench_module("hotload.hotload_adapters").rank(made[0]) == 16
    assert any("making 2 random LoRA adapters (r=16)" in m for m in messages)
