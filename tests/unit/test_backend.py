"""Choosing the backend: auto falls back to peft; an explicit unsloth says why it cannot run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tandem.errors import ConfigError
from tandem.settings import TrainerBackendSettings
from tandem_trainer.backends.peft import PeftBackend
from tandem_trainer.backends.select import resolve_device, select_backend, unsloth_problem
from tandem_trainer.errors import TrainingBackendMissing

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@needs_no_gpu
def test_auto_picks_peft_on_cpu() -> None:
    backend = select_backend(TrainerBackendSettings(kind="auto", device="auto"))
    assert isinstance(backend, PeftBackend) and backend.device.type == "cpu"
    assert backend.active is None
    assert backend._host.gather  # cast matrices cross in one transfer unless switched off
    apart = select_backend(TrainerBackendSettings(kind="auto", device="auto", gather_adapter_copy=False))
    assert isinstance(apart, PeftBackend) and not apart._host.gather


@needs_no_gpu
def test_explicit_unsloth_without_cuda_is_a_config_error() -> None:
    with pytest.raises(TrainingBackendMissing) as info:
        select_backend(TrainerBackendSettings(kind="unsloth", device="auto"))
    assert isinstance(info.value, ConfigError)
    assert "unsloth" in str(info.value) and "CUDA" in str(info.value) and "peft" in str(info.value)


@needs_no_gpu
def test_cuda_without_a_gpu_is_a_config_error() -> None:
    with pytest.raises(TrainingBackendMissing, match="TANDEM_BACKEND__DEVICE"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"


def test_unsloth_needs_cuda_and_the_package() -> None:
    assert "CUDA" in (unsloth_problem("cpu") or "")
    if importlib.util.find_spec("unsloth") is None:
        assert "not installed" in (unsloth_problem("cuda") or "")
    else:
        assert unsloth_problem("cuda") is None


@pytest.mark.parametrize(
    ("trained", "saved", "rounds"),
    [
        (torch.float32, torch.float32, False),
        (torch.float32, torch.bfloat16, True),
        (torch.bfloat16, torch.float16, True),
        (torch.float16, torch.bfloat16, True),
        (torch.bfloat16, torch.float32, False),
    ],
)
def test_master_weights_are_kept_only_when_the_adapter_loses_bits(trained, saved, rounds) -> None:
    from tandem_trainer.backends.peft_files import rounds as _rounds

    assert _rounds(trained, saved) is rounds
