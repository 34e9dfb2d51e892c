"""vLLM's command line and environment from settings (engines/vllm_launcher.py), and its wiring."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.errors import ConfigError
from tandem.settings import EngineSettings, GpuSettings, InferenceSettings
from tandem_inference.engines import own_engine
from tandem_inference.engines.launcher import _shown
from tandem_inference.engines.vllm_launcher import vllm_argv, vllm_env


def settings(mode: str = "split", **engine: object) -> InferenceSettings:
    gpus = GpuSettings(mode="split", inference=[2], trainer=[1]) if mode == "split" else GpuSettings(mode="shared", inference=[0])
    return InferenceSettings(
        engine=EngineSettings(kind="vllm", model="/models/qwen", url="http://127.0.0.1:31000",
                              vllm_python="/opt/vllm/bin/python", **engine),  # type: ignore[arg-type]
        gpus=gpus,
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_serve_command_lora_and_logprob_flags_come_from_settings() -> None:
    argv = vllm_argv(settings(max_lora_rank=32, max_loras_per_batch=4, max_loaded_adapters=6, tp_size=2))
    assert argv[:5] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "/models/qwen"]
    assert (flag(argv, "--host"), flag(argv, "--port"), flag(argv, "--served-model-name")) == ("127.0.0.1", "31000", "base")
    assert "--enable-lora" in argv
    assert (flag(argv, "--max-lora-rank"), flag(argv, "--max-loras"), flag(argv, "--max-cpu-loras")) == ("32", "4", "6")
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"  # tandem.logprobs: temperature-scaled
    assert flag(argv, "--generation-config") == "vllm"
    assert flag(argv, "--api-server-count") == "1" and flag(argv, "--tensor-parallel-size") == "2"
    assert "--enable-prompt-tokens-details" in argv
    assert "--enable-sleep-mode" not in argv and "--api-key" not in argv


def test_cpu_loras_are_never_fewer_than_loras_per_batch() -> None:
    argv = vllm_argv(settings(max_loras_per_batch=8, max_loaded_adapters=2))
    assert flag(argv, "--max-cpu-loras") == "8"


def test_shared_mode_enables_sleep_mode_and_memory_and_graph_flags_map() -> None:
    argv = vllm_argv(settings("shared", mem_fraction_static=0.5, cuda_graph_max_bs=8, extra_args=["--x", "1"]))
    assert "--enable-sleep-mode" in argv
    assert flag(argv, "--gpu-memory-utilization") == "0.5"
    assert flag(argv, "--max-cudagraph-capture-size") == "8" and "--enforce-eager" not in argv
    assert argv[-2:] == ["--x", "1"]
    eager = vllm_argv(settings(disable_cuda_graph=True, cuda_graph_max_bs=8))
    assert "--enforce-eager" in eager and "--max-cudagraph-capture-size" not in eager


def test_shared_mode_with_nothing_to_release_starts_no_sleep_mode() -> None:
    s = settings().model_copy(update={"gpus": GpuSettings(mode="shared", inference=[0], release_tags=[])})
    assert "--enable-sleep-mode" not in vllm_argv(s)


def test_env_switches_on_runtime_lora_and_dev_routes_and_carries_the_key_off_the_command_line() -> None:
    env = vllm_env(settings(admin_api_key="sekret"), base={"PATH": "/bin", "VLLM_API_KEY": "stale"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["VLLM_API_KEY"] == "sekret"
    assert "sekret" not in vllm_argv(settings(admin_api_key="sekret"))
    assert "VLLM_API_KEY" not in vllm_env(settings(), base={"VLLM_API_KEY": "stale"})


@pytest.mark.parametrize("url", ["http://0.0.0.0:31000", "http://10.0.0.5:31000", "http://vllm:31000"])
def test_vllm_off_loopback_is_refused_naming_the_url(url: str) -> None:
    s = settings()
    s = s.model_copy(update={"engine": s.engine.model_copy(update={"url": url})})
    with pytest.raises(ConfigError, match="TANDEM_ENGINE__URL"):
        vllm_argv(s)


def test_a_rank_vllm_cannot_start_with_is_refused_naming_both_settings() -> None:
    with pytest.raises(ValidationError, match="engine.max_lora_rank=48 with engine.kind=vllm"):
        EngineSettings(kind="vllm", max_lora_rank=48)
    assert EngineSettings(kind="sglang", max_lora_rank=48).max_lora_rank == 48


def test_own_engine_starts_vllm_with_its_log_and_n_is_not_fanned_out() -> None:
    s = settings()
    own = own_engine(s)
    assert own is not None and own.log_name == "vllm" and own.argv[3] == "serve"
    assert s.gateway.fan_out_n is False


def test_keys_on_the_command_line_are_hidden_in_logs() -> None:
    assert _shown(["vllm", "--api-key", "k", "--admin-api-key", "a", "--port", "1"]) == [
        "vllm", "--api-key", "***", "--admin-api-key", "***", "--port", "1"]


def test_shared_mode_sizes_the_kv_cache_each_wake_up_maps_and_a_setting_or_flag_overrides_it() -> None:
    gib = 2**30
    assert flag(vllm_argv(settings("shared")), "--kv-cache-memory-bytes") == str(8 * gib)
    assert "--kv-cache-memory-bytes" not in vllm_argv(settings())  # split: no wake-up, vLLM sizes it
    assert flag(vllm_argv(settings(kv_cache_gib=1.5)), "--kv-cache-memory-bytes") == str(3 * gib // 2)
    assert flag(vllm_argv(settings("shared", kv_cache_gib=20)), "--kv-cache-memory-bytes") == str(20 * gib)
    own = vllm_argv(settings("shared", extra_args=["--kv-cache-memory-bytes", "4G"]))
    assert own.count("--kv-cache-memory-bytes") == 1 and flag(own, "--kv-cache-memory-bytes") == "4G"
    joined = vllm_argv(settings("shared", extra_args=["--kv-cache-memory-bytes=4G"]))
    assert [a for a in joined if a.startswith("--kv-cache-memory-bytes")] == ["--kv-cache-memory-bytes=4G"]
    s = settings().model_copy(update={"gpus": GpuSettings(mode="shared", inference=[0], release_tags=[])})
    assert "--kv-cache-memory-bytes" not in vllm_argv(s)  # nothing released, nothing to wake up
    with pytest.raises(ValidationError, match="kv_cache_gib"):
        EngineSettings(kind="vllm", kv_cache_gib=0)


def test_batch_invariant_mode_is_vllms_variable_and_off_unless_asked() -> None:
    assert vllm_env(settings(batch_invariant=True), base={})["VLLM_BATCH_INVARIANT"] == "1"
    assert "VLLM_BATCH_INVARIANT" not in vllm_env(settings(), base={})
