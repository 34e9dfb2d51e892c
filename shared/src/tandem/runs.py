"""A run: one policy being trained, its base model, LoRA shape and training knobs.

Version 0 of every run is the base model itself (no adapter); the first train step publishes
version 1. Adapter names are `<run>-v<version>`: unique per version (SGLang refuses a second
load under a name) and free of ':' (SGLang splits OpenAI model names at the first ':').
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_run_name(name: str) -> str:
    """Return `name` if it is a valid run name, else raise ValueError naming it."""
    if not RUN_NAME.match(name):
        raise ValueError(
            f"run name {name!r} is invalid: use 1-63 letters, digits, '_', '.', '-' "
            "starting with a letter or digit (no ':', '@' or '/')"
        )
    return name


def adapter_name(run: str, version: int) -> str:
    """Engine-side name of a version: unique, never reused, no ':'."""
    return f"{run}-v{version}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraConfig(_Strict):
    """Shape of the LoRA adapter (plain LoRA, so SGLang loads it as it is)."""

    r: int = Field(16, ge=1, le=1024)
    """Rank."""
    alpha: float = Field(32.0, gt=0)
    """Scale numerator: the update is scaled by alpha / r (rslora is never used)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input during training."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Linear modules that get adapters."""

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("lora.target_modules is empty; name at least one module")
        return v


class OptimizerConfig(_Strict):
    """AdamW over the LoRA parameters."""

    lr: float = Field(2e-4, gt=0, le=1)
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Adam betas."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient norm is clipped to this value."""


class LossConfig(_Strict):
    """GRPO loss knobs."""

    kind: Literal["grpo"] = "grpo"
    """Loss family."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip: ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """PPO clip: ratio is clipped above at 1 + clip_high."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL to the reference (the base model, adapter disabled); 0 skips it."""
    normalize_std: bool = True
    """Divide group advantages by the group's reward std (GRPO); False keeps mean-centering only."""
    epochs: int = Field(1, ge=1, le=16)
    """Passes over each job's trajectories."""


class RunSpec(_Strict):
    """Everything the trainer and inference need to know about a run."""

    name: str
    """Run name; the gateway serves its newest version under this name."""
    base_model: str
    """Hub id or local path of the base model (the same for trainer and engine)."""
    lora: LoraConfig = LoraConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    max_staleness_steps: int = Field(1, ge=0, le=64)
    """How many versions older than the parent of the version being trained a rollout may be."""
    seed: int = 0
    """Seed of the LoRA initialisation."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_run_name(v)

    @model_validator(mode="after")
    def _base(self) -> RunSpec:
        if not self.base_model.strip():
            raise ValueError("base_model is empty; give a hub id or a local path")
        return self
