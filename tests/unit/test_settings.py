from __future__ import annotations

import json

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


@pytest.mark.parametrize(("variable", "value"), [
    ("TANDEM_CONTROLLER__RECONCILE_S", "nan"),  # bounded: nan used to fail the bound, named as the fault
    ("TANDEM_ENGINE__BOOT_TIMEOUT_S", "inf"),  # no upper bound: inf used to pass, and print as null
    ("TANDEM_GPUS__LEASE_WAIT_S", "1e400"),
    ("TANDEM_TRAIN_TIMEOUT_S", "Infinity"),  # the client's own, top-level setting
])
def test_every_number_setting_must_be_finite(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    from tandem.errors import ConfigError
    from tandem.settings import SERVICES, load

    monkeypatch.setenv(variable, value)
    refused = []
    for cls in SERVICES.values():
        try:
            load(cls)
        except ConfigError as exc:
            refused.append(str(exc))
    assert refused and all(f"{variable}='{value}': Input should be a finite number" in m for m in refused)


def test_served_model_name_may_not_contain_colon() -> None:
    with pytest.raises(ValidationError, match="served_model_name"):
        EngineSettings(served_model_name="a:b")


def test_secrets_are_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GATEWAY__API_KEY", "hunter2")
    dumped = InferenceSettings().redacted()
    assert dumped["gateway"]["api_key"] == "**********"
    assert "hunter2" not in str(dumped)


def test_every_urls_password_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis's and MLflow's were; the gateway's (client, Tinker) and the engine's were shown as given."""
    from tandem.settings import ClientSettings, TinkerSettings, TrainerSettings

    monkeypatch.setenv("TANDEM_GATEWAY_URL", "http://u:gw-pw@127.0.0.1:8000")
    monkeypatch.setenv("TANDEM_TINKER__GATEWAY_URL", "http://u:tinker-pw@127.0.0.1:8000")
    monkeypatch.setenv("TANDEM_ENGINE__URL", "http://u:engine-pw@127.0.0.1:31000")
    monkeypatch.setenv("TANDEM_TRACKER__MLFLOW_URI", "http://u:mlflow-pw@mlflow:5000")
    monkeypatch.setenv("TANDEM_REDIS__URL", "redis://u:redis-pw@127.0.0.1:6379/0")
    for settings in (ClientSettings(), TinkerSettings(), InferenceSettings(), TrainerSettings()):
        dumped = json.dumps(settings.redacted())
        assert "-pw" not in dumped and "u:***@127.0.0.1:6379" in dumped, dumped
    assert ClientSettings().redacted()["gateway_url"] == "http://u:***@127.0.0.1:8000"
    assert InferenceSettings().redacted()["engine"]["url"] == "http://u:***@127.0.0.1:31000"


def test_load_names_each_bad_variable_on_one_line_and_never_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.errors import ConfigError
    from tandem.settings import InferenceSettings, TrainerSettings, load

    monkeypatch.setenv("TANDEM_GATEWAY__PORT", "abc")
    monkeypatch.setenv("TANDEM_GPUS__INFERENCE", "0")
    monkeypatch.setenv("TANDEM_GATEWAY__API_KEY", "x" * 3)  # fine, and never shown
    with pytest.raises(ConfigError) as info:
        load(InferenceSettings)
    message = str(info.value)
    assert "\n" not in message and "TANDEM_GATEWAY__PORT='abc': Input should be a valid integer" in message
    assert "TANDEM_GPUS__INFERENCE=0: Input should be a valid list" in message and "fix or unset them" in message

    monkeypatch.delenv("TANDEM_GATEWAY__PORT")
    monkeypatch.setenv("TANDEM_GPUS__INFERENCE", "notjson")
    with pytest.raises(ConfigError) as info:
        load(TrainerSettings)
    assert "TANDEM_GPUS__INFERENCE='notjson' is not JSON" in str(info.value) and "\n" not in str(info.value)

    monkeypatch.delenv("TANDEM_GPUS__INFERENCE")
    monkeypatch.setenv("TANDEM_REDIS__URL", "redis://u:SEKRIT@[::1/0")  # a bracket left open
    assert "SEKRIT" not in json.dumps(load(TrainerSettings).redacted())
    monkeypatch.setenv("TANDEM_JOB_TIMEOUT_S", "0")
    with pytest.raises(ConfigError) as info:
        load(TrainerSettings)
    assert "TANDEM_JOB_TIMEOUT_S='0': Input should be greater than or equal to 1" in str(info.value)


def test_a_misspelt_setting_of_a_known_section_is_named_with_what_it_may_mean(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tandem.settings import InferenceSettings, load

    monkeypatch.setenv("TANDEM_GATEWAY__API_KEYS", "s3cret")
    monkeypatch.setenv("TANDEM_BACKEND__NOPE", "1")
    monkeypatch.setenv("TANDEM_COMPOSE", "docker compose")  # no section: another tool's, not looked at
    caplog.set_level("WARNING", logger="tandem.settings.loading")
    assert load(InferenceSettings).gateway.api_key is None  # ignored, as before, but said
    assert ("TANDEM_GATEWAY__API_KEYS names no setting of any tandem service and is ignored; did you mean "
            "TANDEM_GATEWAY__API_KEY?") in caplog.text
    assert "TANDEM_BACKEND__NOPE names no setting of any tandem service and is ignored\n" in caplog.text + "\n"
    assert "TANDEM_COMPOSE" not in caplog.text


def test_a_client_made_with_a_bad_variable_raises_config_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not pydantic's ValidationError naming the field: the client's errors are TandemErrors."""
    from tandem import Client
    from tandem.errors import ConfigError

    monkeypatch.setenv("TANDEM_TRAIN_TIMEOUT_S", "-5")
    with pytest.raises(ConfigError, match="TANDEM_TRAIN_TIMEOUT_S='-5': Input should be greater than 0"):
        Client("http://127.0.0.1:9", "redis://127.0.0.1:9/0")


@pytest.mark.parametrize(("prog", "entry"), [
    ("tandem-engine", "tandem_inference.engines.transformers.server:main"),
    ("tandem-inference", "tandem_inference.main:main"),
    ("tandem-tinker", "tandem_inference.tinker.main:main"),
    ("tandem-trainer", "tandem_trainer.main:main"),
])
def test_a_service_command_answers_help_and_refuses_arguments_before_it_starts(
        prog: str, entry: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`tandem-engine --help` used to load the model and serve on its port, with no admin key."""
    import importlib

    module, name = entry.split(":")
    main = getattr(importlib.import_module(module), name)
    monkeypatch.setenv("TANDEM_REDIS__URL", "redis://127.0.0.1:9/0")  # nothing may be reached before these end
    for argv, code in ((["--help"], 0), (["--port", "5"], 2)):
        monkeypatch.setattr("sys.argv", [prog, *argv])
        with pytest.raises(SystemExit) as ended:
            main()
        assert ended.value.code == code
    out, err = capsys.readouterr()
    assert f"usage: {prog}" in out and "TANDEM_ environment variables" in out and "tandem settings" in out
    assert "unrecognized arguments: --port 5" in err
