"""bench/hotload.py end to end on the tiny model and the transformers engine (quick settings)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from tandem.adapters import AdapterStore, Manifest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "hotload.py"
RUN = "hl"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hotload_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def publish_adapters(store: AdapterStore, model: Path, count: int) -> None:
    """Published versions as the trainer leaves them: LoRA with nonzero B, so each changes outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    for version in range(1, count + 1):
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        with store.staging(RUN, version) as staged:
            peft_model.save_pretrained(staged / "adapter")
            store.publish(staged, Manifest(run=RUN, version=version, parent=version - 1, step=version,
                                           job_id=f"job-{version}", base_model=str(model), lora_rank=8))


def test_quick_run_measures_all_three_and_the_merge_changes_the_served_weights(
    tiny_model: Path, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "adapters")
    publish_adapters(store, tiny_model, 2)
    messages: list[str] = []
    ctx = SimpleNamespace(
        out=tmp_path / "out", quick=True, model=str(tiny_model), engine="transformers",
        tandem_python=sys.executable, sglang_python="python3", engine_env={"TANDEM_LOG_LEVEL": "INFO"},
        store_root=store.root, run_name=RUN, progress=messages.append,
    )
    result = load_bench().run(ctx)

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
