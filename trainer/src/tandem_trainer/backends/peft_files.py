"""The peft backend's version files: reading a version into the model and its optimizer, and
writing the trainer state (master weights, optimizer, param names) beside a published adapter.

A version directory holds `adapter/` (the PEFT files the engines load) and `trainer/` (what only
training needs: `optimizer.pt`, `trainer_state.json` and, when the adapter's dtype rounds the
weights, the float32 master weights, which a resumed run reads instead of the adapter). Every
failure to read or write is a CheckpointError naming the run, the version and the file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from pydantic import JsonValue
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tandem.runs import RunSpec
from tandem_trainer.backends.base import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MASTER_WEIGHTS, OPTIMIZER_STATE, TRAINER_STATE
from tandem_trainer.errors import CheckpointError

log = logging.getLogger(__name__)


def read_version(model: PeftModel, optimizer: torch.optim.Optimizer, param_names: list[str], spec: RunSpec,
                 version: int, version_dir: Path, device: torch.device) -> None:
    """Load `spec`'s version `version` from `version_dir` into the model's adapter and the optimizer
    (a version without optimizer state starts it fresh, and says so)."""
    adapter = version_dir / "adapter"
    # the trainer state's float32 master weights when there are any (the adapter may be bf16)
    master = version_dir / "trainer" / MASTER_WEIGHTS
    try:
        saved = json.loads((adapter / ADAPTER_CONFIG).read_text())
        source = master if master.is_file() else adapter / ADAPTER_WEIGHTS
        weights = load_file(str(source), device=str(device))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{spec.name} v{version}: cannot read adapter in {adapter}: {exc}") from exc
    if saved.get("r") != spec.lora.r or sorted(saved.get("target_modules") or []) != sorted(
        spec.lora.target_modules
    ):
        raise CheckpointError(
            f"{spec.name} v{version}: adapter has r={saved.get('r')} "
            f"targets={saved.get('target_modules')}, "
            f"the run wants r={spec.lora.r} targets={list(spec.lora.target_modules)}"
        )
    expected = set(get_peft_model_state_dict(model))
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{spec.name} v{version}: adapter weights do not fit the run's LoRA "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    set_peft_model_state_dict(model, weights)
    state_path = version_dir / "trainer" / OPTIMIZER_STATE
    if not state_path.is_file():
        log.warning("adapter.activate run=%s version=%d: no optimizer state, starting it fresh", spec.name, version)
        return
    try:
        state = torch.load(state_path, map_location=device, weights_only=True)
        names = json.loads((version_dir / "trainer" / TRAINER_STATE).read_text()).get("param_names")
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{spec.name} v{version}: cannot read optimizer state: {exc}") from exc
    if names is not None and names != param_names:
        raise CheckpointError(f"{spec.name} v{version}: optimizer state is for other parameters")
    optimizer.load_state_dict(state)


def write_trainer_state(model: PeftModel, optimizer: torch.optim.Optimizer,
                        params: list[tuple[str, torch.nn.Parameter]], trainer_dir: Path,
                        trainer_state: dict[str, JsonValue], *, saved_dtype: torch.dtype) -> None:
    """Write the trainer state of the version whose adapter is saved as `saved_dtype` into `trainer_dir`."""
    master = None
    if any(rounds(p.dtype, saved_dtype) for _, p in params):  # keep the originals
        master = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}
    state = {**trainer_state, "param_names": [n for n, _ in params], "torch": torch.__version__}
    try:
        if master is not None:
            save_file(master, str(trainer_dir / MASTER_WEIGHTS), metadata={"format": "pt"})
        torch.save(optimizer.state_dict(), trainer_dir / OPTIMIZER_STATE)
        (trainer_dir / TRAINER_STATE).write_text(json.dumps(state, indent=2))
    except (OSError, SafetensorError, RuntimeError) as exc:  # RuntimeError: torch.save's writer
        raise CheckpointError(f"cannot write the trainer state to {trainer_dir}: {exc}") from exc


def rounds(trained: torch.dtype, saved: torch.dtype) -> bool:
    """Whether saving weights trained in `trained` as `saved` loses bits (float32 -> bfloat16
    does, bfloat16 <-> float16 does both ways, bfloat16 -> float32 does not)."""
    return trained != saved and torch.finfo(saved).bits <= torch.finfo(trained).bits
