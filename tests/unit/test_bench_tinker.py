"""bench/scenarios/tinker.py's parts that need no stack: the SDK's key (`tml-` + the gateway's, or any
`tml-` key on a keyless stack), the suite's `--only tinker`, and the bench stack starting the Tinker
service in the tandem interpreter only for this scenario (the suite's CPU run measures the rest)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.bench import bench_module

from tandem.dev.composition import StackConfig

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tinker_scenario():
    return bench_module("scenarios.tinker")


def test_the_key_is_the_gateways_with_tml_before_it(tinker_scenario, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_GATEWAY__API_KEY", raising=False)
    assert tinker_scenario.api_key(SimpleNamespace(engine_env={})) == "tml-bench"  # keyless: any tml- key
    assert tinker_scenario.api_key(SimpleNamespace(engine_env={"TANDEM_GATEWAY__API_KEY": "k1"})) == "tml-k1"
    monkeypatch.setenv("TANDEM_GATEWAY__API_KEY", "tml-k2")
    assert tinker_scenario.api_key(SimpleNamespace(engine_env={})) == "tml-k2"


def test_only_tinker_selects_it() -> None:
    suite = bench_module("suite")
    assert suite.selected("tinker") == ["tinker"]
    assert "tinker" in suite.selected("")


def test_the_bench_stack_serves_tinker_only_for_its_scenario(tmp_path: Path) -> None:
    pytest.importorskip("tinker")
    benchlib = bench_module("benchlib")
    config = StackConfig(state_dir=tmp_path, model=str(tmp_path / "model"), gateway_port=0)

    def plan(tinker: bool) -> dict[str, list[str]]:
        stack = benchlib.BenchStack(config, engine="transformers", tandem_python="/opt/td/python",
                                    trainer_python="/opt/tr/python", tinker=tinker)
        return {s.name: s.argv for s in stack.plan()}

    assert "tinker" not in plan(False)
    services = plan(True)
    assert services["tinker"] == ["/opt/td/python", "-m", "tandem_inference.tinker"]
    assert list(services)[-1] == "tinker"  # after the gateway and the trainer it fronts
