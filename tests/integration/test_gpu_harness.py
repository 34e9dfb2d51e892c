"""The GPU checks' own harness, run on the CPU engine: what broke there costs a GPU session to find.

`bench/gpu/gpu_mixed.py` starts the engine under test exactly as tandem would launch it and waits for
its health; the gpu-marked test_engine_batches drives it. Here the same `start` runs the
transformers engine: it must leave no file of its own open (pytest turns the warning of a dropped
log file into a failure, as it did on the GPU) and must say which log to read when the engine dies.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import httpx
import pytest
from helpers.bench import bench_module
from helpers.loopback import free_port

from tandem.settings import EngineSettings, InferenceSettings

pytestmark = pytest.mark.integration


def settings_for(model: Path, monkeypatch: pytest.MonkeyPatch) -> InferenceSettings:
    port = free_port()
    monkeypatch.setenv("TANDEM_ENGINE__PORT", str(port))  # the engine process reads its own settings
    monkeypatch.setenv("TANDEM_ENGINE__MODEL", str(model))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return InferenceSettings(engine=EngineSettings(kind="transformers", launch=True, model=str(model),
                                                   url=f"http://127.0.0.1:{port}"))


def test_the_engine_starts_with_its_output_in_the_log_and_no_file_left_open(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixed = bench_module("gpu.gpu_mixed")
    settings = settings_for(tiny_model, monkeypatch)
    log = tmp_path / "engine.log"
    proc = mixed.start(settings, log)
    try:
        assert httpx.get(f"{settings.engine.url}/health", timeout=5).status_code == 200
        gc.collect()  # a log file dropped unclosed would warn here, and the warning fails the test
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "engine_settings" in log.read_text(), log.read_text()[-2000:]


def test_an_engine_that_dies_while_booting_names_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mixed = bench_module("gpu.gpu_mixed")
    settings = settings_for(tmp_path / "no-model-here", monkeypatch)
    log = tmp_path / "engine.log"
    with pytest.raises(SystemExit, match=rf"transformers exited with \d+; see {re.escape(str(log))}$"):
        mixed.start(settings, log)
    gc.collect()
    assert "no-model-here" in log.read_text()
