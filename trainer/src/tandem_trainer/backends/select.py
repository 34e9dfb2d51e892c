"""Choosing the backend: the one `backend.kind` asks for, on the device `backend.device` names.

`auto` takes Unsloth where it can run (CUDA, and the package installed), else peft; an
explicit `unsloth` that cannot run is a configuration error that says why and what to set.
The backend modules are imported only once chosen: Unsloth patches transformers on import.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Literal

from tandem.settings import TrainerBackendSettings
from tandem_trainer.backends.base import Backend
from tandem_trainer.errors import TrainingBackendMissing

log = logging.getLogger(__name__)

Device = Literal["cpu", "cuda"]


def resolve_device(kind: Literal["auto", "cpu", "cuda"]) -> Device:
    """`auto` -> cuda when torch sees a GPU, else cpu; `cuda` without one is a ConfigError."""
    import torch

    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise TrainingBackendMissing(
            "backend.device='cuda' but torch sees no CUDA device "
            f"(torch {torch.__version__}); set TANDEM_BACKEND__DEVICE=cpu or auto"
        )
    return kind


def unsloth_problem(device: Device) -> str | None:
    """Why the Unsloth backend cannot run here, or None when it can."""
    if device != "cuda":
        return f"the Unsloth backend needs CUDA and the trainer runs on {device}"
    if importlib.util.find_spec("unsloth") is None:
        return "unsloth is not installed (install tandem-trainer[unsloth] in the trainer image)"
    return None


def select_backend(settings: TrainerBackendSettings, *, device_index: int | None = None,
                   shared_gpu: bool = False) -> Backend:
    """The backend `settings.kind` asks for; `auto` falls back to peft. `device_index` picks the
    GPU of a data-parallel rank (default: the current CUDA device); `shared_gpu` (shared mode with
    release tags: the GPU's free memory is inference's, lent for the job) keeps resident runs off
    the GPU unless a budget is set."""
    from tandem_trainer.backends.resident import ResidentBudget

    device = resolve_device(settings.device)
    place = f"cuda:{device_index}" if device == "cuda" and device_index is not None else device
    resident = ResidentBudget(runs=settings.resident_runs, device_bytes=settings.resident_device_bytes,
                              host_bytes=settings.resident_host_bytes, shared_gpu=shared_gpu)
    if settings.kind in ("auto", "unsloth"):
        problem = unsloth_problem(device)
        if problem is None:  # pragma: no cover - needs CUDA and unsloth (GPU tests)
            from tandem_trainer.backends.unsloth import UnslothBackend

            log.info("backend %s: using unsloth", settings.kind)
            return UnslothBackend(device=place, adapter_dtype=settings.adapter_dtype, resident=resident,
                                  gather_copy=settings.gather_adapter_copy)
        if settings.kind == "unsloth":
            raise TrainingBackendMissing(
                f"backend.kind='unsloth' cannot be used: {problem}; "
                "set TANDEM_BACKEND__KIND=peft (or auto)"
            )
        log.info("backend auto: using peft (%s)", problem)
    from tandem_trainer.backends.peft import PeftBackend

    return PeftBackend(device=place, gradient_checkpointing=settings.gradient_checkpointing,
                       adapter_dtype=settings.adapter_dtype, resident=resident,
                       gather_copy=settings.gather_adapter_copy)
