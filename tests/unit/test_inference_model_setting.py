"""A served model the inference service cannot read stops it with one line naming the setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.errors import ConfigError
from tandem_inference.main import load_tokenizer


def test_a_model_directory_that_does_not_exist_is_named_with_its_setting(tmp_path: Path) -> None:
    missing = tmp_path / "no-model-here"
    with pytest.raises(ConfigError, match=f"engine.model '{missing}' \\(TANDEM_ENGINE__MODEL\\): no such directory"):
        load_tokenizer(str(missing))


def test_a_directory_without_a_model_says_what_it_lacks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TANDEM_ENGINE__MODEL.*config.json"):
        load_tokenizer(str(tmp_path))


def test_the_service_exits_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update({"TANDEM_ENGINE__MODEL": str(tmp_path / "no-model-here"), "TANDEM_REDIS__URL": "redis://127.0.0.1:1/0",
                "HF_HUB_OFFLINE": "1"})
    proc = subprocess.run([sys.executable, "-m", "tandem_inference.main"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "TANDEM_ENGINE__MODEL" in errors[0] and "no such directory" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
