from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.errors import ConfigError
from tandem.settings import EngineSettings, GpuSettings, InferenceSettings
from tandem_inference.engines.sglang_launcher import sglang_argv, sglang_env


def settings(**engine) -> InferenceSettings:
    return InferenceSettings(
        engine=EngineSettings(kind="sglang", model="/models/qwen", url="http://127.0.0.1:31000", **engine),
        gpus=GpuSettings(mode="split", inference=[0], trainer=[1]),
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_lora_flags_come_from_settings() -> None:
    argv = sglang_argv(settings(max_lora_rank=32, max_loras_per_batch=4, max_loaded_adapters=6))
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert "--enable-lora" in argv and "--enable-metrics" in argv and "--enable-cache-report" in argv
    assert flag(argv, "--max-lora-rank") == "32"
    assert flag(argv, "--max-loras-per-batch") == "4"
    assert flag(argv, "--max-loaded-loras") == "6"
    assert flag(argv, "--port") == "31000" and flag(argv, "--model-path") == "/models/qwen"
    targets = argv[argv.index("--lora-target-modules") + 1 : argv.index("--max-loras-per-batch")]
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert flag(argv, "--tokenizer-worker-num") == "1"
    assert "--enable-memory-saver" not in argv and "--admin-api-key" not in argv


def test_shared_mode_enables_the_memory_saver_and_keys_pass_through() -> None:
    s = settings(admin_api_key="sekret", mem_fraction_static=0.5, cuda_graph_max_bs=8, extra_args=["--x", "1"])
    s = s.model_copy(update={"gpus": GpuSettings(mode="shared", inference=[0])})
    argv = sglang_argv(s)
    assert "--enable-memory-saver" in argv
    assert flag(argv, "--admin-api-key") == "sekret"
    assert flag(argv, "--mem-fraction-static") == "0.5"
    assert flag(argv, "--cuda-graph-max-bs-decode") == "8"
    assert argv[-2:] == ["--x", "1"]


def test_shared_mode_with_nothing_to_release_starts_no_memory_saver() -> None:
    s = settings().model_copy(update={"gpus": GpuSettings(mode="shared", inference=[0], release_tags=[])})
    assert "--enable-memory-saver" not in sglang_argv(s)
    s = settings().model_copy(update={"gpus": GpuSettings(mode="shared", inference=[0], release_tags=["weights"])})
    assert {"--enable-memory-saver", "--enable-weights-cpu-backup"} <= set(sglang_argv(s))


def test_serving_while_training_needs_nothing_released_and_takes_no_lease() -> None:
    with pytest.raises(ValidationError, match=r"serve_while_training needs gpus.release_tags=\[\], but it is \['kv_cache'\]"):
        GpuSettings(mode="shared", serve_while_training=True)
    serving = GpuSettings(mode="shared", release_tags=[], serve_while_training=True)
    assert not serving.leased and not serving.lends_memory
    assert GpuSettings(mode="shared", release_tags=[]).leased
    assert GpuSettings(mode="shared").leased and GpuSettings(mode="shared").lends_memory
    split = GpuSettings(mode="split", serve_while_training=True)  # ignored: split mode always serves
    assert not split.leased and not split.lends_memory


def test_disable_cuda_graph_wins_over_max_bs() -> None:
    argv = sglang_argv(settings(disable_cuda_graph=True, cuda_graph_max_bs=8))
    assert "--disable-cuda-graph" in argv and "--cuda-graph-max-bs-decode" not in argv


def test_engine_sees_only_its_gpus() -> None:
    env = sglang_env(settings(), base={"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"


def test_eager_adapter_slot_is_the_patched_sglangs_variable_on_unless_switched_off() -> None:
    assert sglang_env(settings(), base={})["SGLANG_LORA_EAGER_SLOT"] == "1"
    off = sglang_env(settings(eager_adapter_slot=False), base={"SGLANG_LORA_EAGER_SLOT": "1"})
    assert off["SGLANG_LORA_EAGER_SLOT"] == "0"  # the setting, not what the environment had


def test_prefill_graphs_from_one_token_are_the_patched_sglangs_variable_on_unless_switched_off() -> None:
    assert sglang_env(settings(), base={})["SGLANG_PREFILL_GRAPHS_FROM_ONE"] == "1"
    off = sglang_env(settings(prefill_graphs_from_one_token=False), base={"SGLANG_PREFILL_GRAPHS_FROM_ONE": "1"})
    assert off["SGLANG_PREFILL_GRAPHS_FROM_ONE"] == "0"  # the setting, not what the environment had


@pytest.mark.parametrize("url", ["http://0.0.0.0:31000", "http://10.0.0.5:31000", "http://sglang:31000"])
def test_sglang_off_loopback_is_refused_naming_the_url(url: str) -> None:
    with pytest.raises(ConfigError, match=f"engine.url '{url}' makes SGLang listen on .*TANDEM_ENGINE__URL"):
        sglang_argv(settings().model_copy(update={"engine": EngineSettings(kind="sglang", model="/m", url=url)}))


@pytest.mark.parametrize("url", ["http://127.0.0.1:31000", "http://localhost:31000", "http://[::1]:31000"])
def test_sglang_on_loopback_listens_there(url: str) -> None:
    argv = sglang_argv(settings().model_copy(update={"engine": EngineSettings(kind="sglang", model="/m", url=url)}))
    assert flag(argv, "--host") == url.split("//")[1].rsplit(":", 1)[0].strip("[]")
