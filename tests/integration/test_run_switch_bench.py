"""bench/run_switch.py on the tiny model, a few steps: the report's structure, steps that really
trained both runs, and B's switches after A that are swaps in memory reading nothing from the store
(while the phase that keeps no run resident reads each switch's version). Timings are reported by
the script and never checked here."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers.bench import bench_module
from helpers.store_reads import counted_reads
from safetensors.torch import load_file

from tandem.adapters import AdapterStore

pytestmark = pytest.mark.integration

SMALL = {"samples": 2, "prompt": 6, "completion": 8, "rank": 4}


def adapter(store: AdapterStore, run: str, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(store.adapter_dir(run, version) / "adapter_model.safetensors"))


def test_the_bench_trains_both_runs_and_b_after_a_is_a_swap_in_memory(tiny_model: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run_switch = bench_module("run_switch")
    config = run_switch.Config(model=str(tiny_model), out=tmp_path, steps=2, warmup=1, rounds=2, **SMALL)
    store = AdapterStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    reads: dict[str, Counter[str]] = {}

    @contextmanager
    def phase(name: str) -> Iterator[None]:
        with counted_reads(monkeypatch, store) as counted:
            yield
        reads[name] = reads.get(name, Counter()) + counted

    measured = run_switch.measure(config, progress=lambda msg: None, phase=phase, store=store)
    result = run_switch.report(measured, config)

    # B's steps alone never switch; after A (both resident) each is a swap in memory, no store read;
    # with no run resident each switch reads the parent version's weights and optimizer state
    assert reads["alone"] == {} and reads["interleaved"] == {} and reads["warmup"] == {}
    assert reads["store"] == {"weights": 4, "optimizer": 4}  # 2 pairs: each of A's and B's parents read
    rows = {row["case"]: row for row in result["rows"]}
    assert list(rows) == ["B alone", "B after A, resident", "A after B, resident", "B after A, from the store"]
    assert rows["B alone"]["outcomes"] == {"active": 2} and rows["B alone"]["n"] == 2
    assert rows["B after A, resident"]["outcomes"] == {"hit": 2}  # the CPU's one tier: host memory
    assert rows["B after A, from the store"]["outcomes"] == {"miss": 2}
    for row in rows.values():
        assert all(math.isfinite(row[key]) and row[key] >= 0 for key in row if key.endswith("_ms"))
    assert set(result["verdict"]) == {"p50", "p95"}
    for verdict in result["verdict"].values():
        assert isinstance(verdict["met"], bool)
        assert verdict["bound_ms"] == pytest.approx(verdict["b_alone_ms"] + verdict["swap_ms"])
        assert verdict["margin_ms"] == pytest.approx(verdict["bound_ms"] - verdict["b_after_a_ms"])
    assert result["table"].startswith("| case |") and len(result["verdict_lines"]) == 2

    # the steps trained: every step published a version, each from the one before, and the weights moved
    records = measured["records"]
    steps = Counter((r["run"] + ("-store" if r["phase"].startswith("store") else "")) for r in records)
    # warm-up, alone, interleaved; the store's warm-up and its pairs
    assert steps == {"a": 2 + 0 + 2, "b": 3 + 2 + 2, "a-store": 2 + 2, "b-store": 2 + 2}
    for run in steps:
        role, phases = run[0], {"warmup", "alone", "interleaved"} if len(run) == 1 else {"store-warmup", "store"}
        assert store.versions(run) == list(range(1, steps[run] + 1))
        assert [r["parent"] for r in records if r["run"] == role and r["phase"] in phases] == list(range(steps[run]))
        first, last = adapter(store, run, 1), adapter(store, run, steps[run])
        assert first.keys() == last.keys() and any(not torch.equal(first[k], last[k]) for k in first)
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    a, b = adapter(store, "a", steps["a"]), adapter(store, "b", steps["b"])
    assert any(not torch.equal(a[k], b[k]) for k in a)  # two runs, two adapters

def test_the_command_writes_its_results(tiny_model: Path, tmp_path: Path) -> None:
    run_switch = bench_module("run_switch")
    argv = ["--model", str(tiny_model), "--out", str(tmp_path), "--steps", "1", "--warmup", "0",
            "--no-store-phase", *[f"--{key}={value}" for key, value in SMALL.items()]]
    assert run_switch.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [row["case"] for row in result["rows"]] == ["B alone", "B after A, resident", "A after B, resident"]
    assert result["config"]["steps"] == 1 and result["config"]["store_phase"] is False
    assert {"torch", "transformers", "peft"} <= result["versions"].keys() and result["machine"]["cpu_count"]
    assert "B after A" in (tmp_path / "report.md").read_text()
