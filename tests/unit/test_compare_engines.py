"""bench/report/compare_engines.py: the side-by-side page of two suite runs, and bench/report/engine_log.py.

The fixtures are two quick suite runs on the CPU engine (`python bench/suite.py --quick --only
sync,swaps,agreement,hotload,throughput,memory`) and one `bench/gpu/gpu_check.py --engine transformers
--backend peft --mode shared --steps 3`, trimmed to what the page reads (per-request rows dropped).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from helpers.bench import bench_module

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


@pytest.fixture(scope="module")
def compare():
    return bench_module("report.compare_engines")


@pytest.fixture(scope="module")
def engine_log():
    return bench_module("report.engine_log")


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return data


def section(page: str, title: str) -> list[list[str]]:
    """The rows of the first table under the heading `title`, split into cells."""
    part = page.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in part.splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]


def test_each_throughput_cell_side_by_side_with_the_ratio(compare) -> None:
    a, b = fixture("suite-a.json"), fixture("suite-b.json")
    rows = section(compare.page([a, b], [None, None]), "Rollout throughput (scenario 10)")
    cells_a = {(c["concurrency"], c["adapters"]): c for c in a["scenarios"]["throughput"]["rows"]}
    cells_b = {(c["concurrency"], c["adapters"]): c for c in b["scenarios"]["throughput"]["rows"]}
    assert len(rows) == len(cells_a) == 4
    for row in rows:
        key = (int(row[0]), int(row[1]))
        assert row[2] == f"{cells_a[key]['tokens_per_s']:.0f}" and row[3] == f"{cells_b[key]['tokens_per_s']:.0f}"
        assert row[4] == f"{cells_b[key]['tokens_per_s'] / cells_a[key]['tokens_per_s']:.2f}"
        assert row[7] == f"{cells_a[key]['errors']} / {cells_a[key]['refused']}"


def test_sync_memory_agreement_and_hotload_come_from_each_run(compare) -> None:
    a, b = fixture("suite-a.json"), fixture("suite-b.json")
    page = compare.page([a, b], [None, None])
    sync = {r[0]: r[1:] for r in section(page, "Policy sync (scenario 1)")}
    for i, run in enumerate((a, b)):
        served = run["scenarios"]["sync"]["summary"]["publish_to_served_ms"]
        assert sync["publish → served"][i] == f"{served['p50']:.1f} / {served['p95']:.1f}"
    memory = {r[0]: r[1:] for r in section(page, "Engine memory across versions (scenario 11)")}
    assert memory["what is measured"] == ["RSS of the engine's processes"] * 2
    assert memory["growth"][1] == f"{100 * b['scenarios']['memory']['summary']['rss_mib']['growth']:+.1f} %"
    assert memory["growth ≤ 5 %"][0] == ("flat (met)" if a["scenarios"]["memory"]["goals"][0]["met"]
                                         else "**growing (missed)**")
    hot = {r[0]: r[1:] for r in section(page, "Hot-load against a restart (scenario 2)")}
    assert hot["restart / hot-load"][0] == f"{a['scenarios']['hotload']['summary']['restart_over_hotload']:.1f}"
    agree = {r[0]: r[1:] for r in section(page, "Rollout/trainer agreement (scenario 9)")}
    row = next(x for x in b["scenarios"]["agreement"]["rows"] if x["temperature"] == 1.0 and x["top_p"] == 0.9)
    assert agree["1.0, 0.9"][1].startswith(f"{row['mean_abs']:.1e} / {row['max_abs']:.1e}")


def test_a_gpu_engines_host_memory_stands_beside_its_gpu_memory(compare) -> None:
    # A GPU engine's series is its GPU memory; its CPU copies of adapters show only in the RSS
    a, b = fixture("suite-a.json"), copy.deepcopy(fixture("suite-b.json"))
    summary = b["scenarios"]["memory"]["summary"]
    summary["measured"], summary["gpu_mib"] = "gpu_mib", {**summary["rss_mib"], "slope_mib_per_10": 0.0}
    summary["rss_mib"] = {**summary["rss_mib"], "first": 4189.0, "last": 6725.0, "slope_mib_per_10": 256.6}
    memory = {r[0]: r[1:] for r in section(compare.page([a, b], [None, None]),
                                           "Engine memory across versions (scenario 11)")}
    assert memory["what is measured"] == ["RSS of the engine's processes", "GPU memory of the engine"]
    assert memory["MiB per 10 versions"][1] == "+0.0"
    # the CPU run's series is already its RSS: no second copy of it
    assert memory["host memory (RSS of the engine's processes) after the first version, MiB"] == ["–", "4189"]
    assert memory["… after the last, MiB"] == ["–", "6725"]
    assert memory["… MiB per 10 versions"] == ["–", "+256.6"]


def test_agreement_recomputed_by_several_trainer_backends_has_a_row_each(compare) -> None:
    a, b = copy.deepcopy(fixture("suite-a.json")), copy.deepcopy(fixture("suite-b.json"))
    for run, shift in ((a, 0.0), (b, 0.001)):
        rows = [x for x in run["scenarios"]["agreement"]["rows"] if "control" not in x]
        run["scenarios"]["agreement"]["rows"] = ([{**x, "backend": "peft"} for x in rows]
                                                 + [{**x, "backend": "unsloth", "mean_abs": x["mean_abs"] + shift + 0.5}
                                                    for x in rows])
    agree = {r[0]: r[1:] for r in section(compare.page([a, b], [None, None]), "Rollout/trainer agreement (scenario 9)")}
    assert len(agree) == 12
    peft = next(x for x in b["scenarios"]["agreement"]["rows"]
                if x["backend"] == "peft" and x["temperature"] == 0.7 and x["top_p"] == 1.0)
    unsloth = next(x for x in b["scenarios"]["agreement"]["rows"]
                   if x["backend"] == "unsloth" and x["temperature"] == 0.7 and x["top_p"] == 1.0)
    assert agree["peft, 0.7, 1.0"][1].startswith(f"{peft['mean_abs']:.1e} / ")
    assert agree["unsloth, 0.7, 1.0"][1].startswith(f"{unsloth['mean_abs']:.1e} / ")
    # a run of one backend beside it: its rows carry none, and show as a dash under the other's names
    c = fixture("suite-b.json")
    agree = {r[0]: r[1:] for r in section(compare.page([a, c], [None, None]), "Rollout/trainer agreement (scenario 9)")}
    assert agree["–, 0.7, 1.0"][1] != "–" and agree["peft, 0.7, 1.0"][1] == "–"


def test_the_runs_are_labelled_and_a_goal_with_a_bar_keeps_its_cell(compare) -> None:
    a, b = fixture("suite-a.json"), fixture("suite-b.json")
    page = compare.page([a, b], [None, None])
    # both fixtures ran the CPU engine: the labels tell them apart by their timestamps
    assert page.startswith(f"# transformers ({a['meta']['timestamp']}) against transformers ({b['meta']['timestamp']})")
    goals = section(page, "Goals")
    assert all(len(g) == 4 for g in goals)
    assert any("\\|Δ logprob\\|" in g[1] for g in goals)
    b["meta"]["engine"], b["meta"]["transformers_env"] = "transformers", {"transformers": "9.9"}
    assert "against transformers 9.9 on the same loop" in compare.page([a, b], [None, None])


def test_a_scenario_missing_or_failed_in_one_run_shows_as_a_dash(compare) -> None:
    a, b = fixture("suite-a.json"), copy.deepcopy(fixture("suite-b.json"))
    del b["scenarios"]["memory"]
    b["scenarios"]["swaps"] = {"name": "swaps", "title": "3. Serving during swaps", "error": "RuntimeError: boom",
                               "goals": []}
    page = compare.page([a, b], [None, None])
    assert all(r[2] == "–" for r in section(page, "Engine memory across versions (scenario 11)"))
    assert all(r[2] == "–" and r[1] != "–" for r in section(page, "Serving during swaps (scenario 3)"))


def test_hand_over_times_from_gpu_check_when_the_suite_ran_split(compare) -> None:
    a, b = fixture("suite-a.json"), fixture("suite-b.json")
    page = compare.page([a, b], [None, None])
    assert "Neither run holds a shared-mode hand-over" in page
    check = fixture("check-shared.json")
    rows = {r[0]: r[1:] for r in section(compare.page([a, b], [check, None]), "Shared-mode hand-over")}
    summary = check["summary"]["handover"]
    assert rows["hand-overs"] == [str(summary["count"]), "–"]
    release = summary["release_ms"]
    assert rows["release (SGLang) / sleep (vLLM), p50 / max ms"][0] == f"{release['p50']:.1f} / {release['max']:.1f}"


def test_a_file_that_is_not_a_suite_result_is_refused_by_name(compare, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "check.json"
    bad.write_text(json.dumps(fixture("check-shared.json")))
    code = compare.main([str(bad), str(FIXTURES / "suite-b.json")])
    err = capsys.readouterr().err
    assert code == 2 and str(bad) in err and "--handover" in err
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(compare.ResultsError, match="broken.json"):
        compare.load(tmp_path / "broken.json")


def test_main_writes_the_page(compare, tmp_path: Path) -> None:
    out = tmp_path / "engines.md"
    assert compare.main([str(FIXTURES / "suite-a.json"), str(FIXTURES / "suite-b.json"), "--handover",
                         str(FIXTURES / "check-shared.json"), str(FIXTURES / "check-shared.json"),
                         "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Shared-mode hand-over" in text and "Neither run" not in text


def test_engine_log_pairs_each_lend_with_its_return(engine_log) -> None:
    log = "\n".join([
        "2026-11-27 00:30:20,001 INFO tandem_inference starting engine: /opt/vllm/bin/python -m vllm serve /m --port 30001",
        "2026-11-27 00:30:41,002 INFO tandem_inference engine healthy in 21.4 s (pid 77)",
        "2026-11-27 00:30:50,000 INFO tandem_inference gpu lent to the trainer: drain_ms=1.5 release_ms=310.0",
        "2026-11-27 00:30:52,000 INFO tandem_inference gpu back: lent_ms=2000.0 resume_ms=450.5",
        "2026-11-27 00:30:53,000 INFO tandem_inference gpu lent to the trainer: drain_ms=0.5 release_ms=290.0",
        "2026-11-27 00:30:55,000 INFO tandem_inference gpu back: lent_ms=1800.0 resume_ms=420.5",
        "2026-11-27 00:30:56,000 INFO tandem_inference gpu lent to the trainer: drain_ms=0.1 release_ms=280.0",
    ])
    rec = engine_log.record(log)
    assert rec["engine_command"] == "/opt/vllm/bin/python -m vllm serve /m --port 30001"
    assert rec["engine_boot_s"] == 21.4 and rec["engine_starts"] == 1
    assert rec["handovers"] == [{"drain_ms": 1.5, "release_ms": 310.0, "lent_ms": 2000.0, "resume_ms": 450.5},
                                {"drain_ms": 0.5, "release_ms": 290.0, "lent_ms": 1800.0, "resume_ms": 420.5}]
    assert rec["handover"]["count"] == 2  # the last lend has not come back
    assert rec["handover"]["release_ms"] == {"p50": 300.0, "max": 310.0}
    assert engine_log.record("")["handover"] == {"count": 0, "drain_ms": None, "release_ms": None, "lent_ms": None,
                                                 "resume_ms": None}


def test_one_engines_runs_given_comma_separated_are_merged_scenario_by_scenario(compare, tmp_path: Path) -> None:
    a = fixture("suite-a.json")
    first = {"meta": a["meta"], "scenarios": {k: v for k, v in a["scenarios"].items() if k in ("sync", "swaps")}}
    later = copy.deepcopy({"meta": {**a["meta"], "timestamp": "later"},
                           "scenarios": {k: v for k, v in a["scenarios"].items() if k != "sync"}})
    later["scenarios"]["swaps"]["marker"] = "from the later run"
    (tmp_path / "one.json").write_text(json.dumps(first))
    (tmp_path / "two.json").write_text(json.dumps(later))
    merged = compare.load_parts(f"{tmp_path / 'one.json'},{tmp_path / 'two.json'}")
    assert merged["meta"] == a["meta"]  # the first run's
    assert set(merged["scenarios"]) == set(a["scenarios"])
    assert merged["scenarios"]["sync"] == a["scenarios"]["sync"]
    assert merged["scenarios"]["swaps"]["marker"] == "from the later run"
    out = tmp_path / "engines.md"
    assert compare.main([f"{tmp_path / 'one.json'},{tmp_path / 'two.json'}", str(FIXTURES / "suite-b.json"),
                         "--out", str(out)]) == 0
    assert compare.page([merged, fixture("suite-b.json")], [None, None]) == out.read_text()


def test_runs_of_two_engines_are_not_merged_into_one(compare, tmp_path: Path) -> None:
    other = fixture("suite-a.json")
    other["meta"] = {**other["meta"], "engine": "vllm"}
    (tmp_path / "vllm.json").write_text(json.dumps(other))
    with pytest.raises(compare.ResultsError, match="give each engine's runs as one argument"):
        compare.load_parts(f"{FIXTURES / 'suite-a.json'},{tmp_path / 'vllm.json'}")
