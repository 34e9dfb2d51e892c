"""On a GPU: the Unsloth backend trains a real job and writes an adapter SGLang can load as is."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tandem.adapters import AdapterStore
from tandem.registry import Registry
from tandem.runs import LoraConfig, RunSpec
from tandem.settings import RedisSettings, StoreSettings, TrainerBackendSettings, TrainerSettings

pytestmark = [pytest.mark.integration, pytest.mark.gpu]


def test_auto_picks_unsloth_and_publishes_a_plain_lora(redis_conn, redis_url: str, tiny_model: Path, tmp_path: Path) -> None:
    if importlib.util.find_spec("unsloth") is None:
        pytest.skip("unsloth is not installed in this environment")
    from tandem_trainer.backends.select import select_backend
    from tandem_trainer.jobs.runner import Trainer

    settings = TrainerSettings(redis=RedisSettings(url=redis_url), store=StoreSettings(root=tmp_path),
                               backend=TrainerBackendSettings(kind="auto"))
    backend = select_backend(settings.backend)
    assert backend.name == "unsloth"
    Registry(redis_conn).create_run(RunSpec(name="g", base_model=str(tiny_model), lora=LoraConfig(r=8, alpha=16)))
    traj = {"prompt_ids": [1, 2, 3], "completion_ids": [18, 19, 20], "rollout_logprobs": [-6.0, -6.0, -6.0]}
    job = {"run": "g", "groups": [{"trajectories": [{**traj, "reward": 1.0}, {**traj, "reward": 0.0}]}]}
    result = Trainer(settings, redis_conn, backend).train(job)
    assert result.version == 1
    store = AdapterStore(tmp_path)
    store.verify("g", 1)
    config = json.loads((store.adapter_dir("g", 1) / "adapter_config.json").read_text())
    assert config["r"] == 8 and not config.get("use_rslora") and not config.get("modules_to_save")
    assert not list(store.adapter_dir("g", 1).glob("tokenizer*"))
