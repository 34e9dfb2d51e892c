from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.settings import EngineSettings, InferenceSettings, TrainerSettings


def test_env_vars_use_prefix_and_nesting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_REDIS__URL", "redis://example:6390/2")
    monkeypatch.setenv("TANDEM_ENGINE__MAX_LORA_RANK", "32")
    monkeypatch.setenv("TANDEM_CONTROLLER__KEEP_VERSIONS", "4")
    s = InferenceSettings()
    assert s.redis.url == "redis://example:6390/2"
    assert s.engine.max_lora_rank == 32
    assert s.controller.keep_versions == 4


def test_unknown_keys_in_env_file_are_ignored(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("TANDEM_BACKEND__KIND=peft\nTANDEM_NOT_A_SETTING=1\nOTHER=2\n")
    assert TrainerSettings().backend.kind == "peft"
    assert InferenceSettings().engine.kind == "transformers"


def test_bounds_are_enforced_with_the_field_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_ENGINE__MAX_LORA_RANK", "0")
    with pytest.raises(ValidationError, match="max_lora_rank"):
        InferenceSettings()


def test_served_model_name_may_not_contain_colon() -> None:
    with pytest.raises(ValidationError, match="served_model_name"):
        EngineSettings(served_model_name="a:b")


def test_secrets_are_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GATEWAY__API_KEY", "hunter2")
    dumped = InferenceSettings().redacted()
    assert dumped["gateway"]["api_key"] == "**********"
    assert "hunter2" not in str(dumped)
