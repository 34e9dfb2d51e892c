"""A run: one policy being trained, its base model, LoRA shape and training knobs.

Version 0 of every run is the base model itself (no adapter); the first train step publishes
version 1. Adapter names are `<run>-v<version>` (`-a<N>` appended from a version's second load
attempt on): never reused (SGLang refuses a second load under a name) and free of ':' (SGLang
splits OpenAI model names at the first ':').
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_run_name(name: str) -> str:
    """Return `name` if it is a valid run name, else raise ValueError naming it."""
    if not RUN_NAME.fullmatch(name):
        raise ValueError(
            f"run name {name!r} is invalid: use 1-63 letters, digits, '_', '.', '-' "
            f"starting with a letter or digit (no ':', '@' or '/'){tinker_model_hint(name)}"
        )
    return name


#: The id the tinker SDK gives a model it opens from a checkpoint: `<session_id>:train:<model_seq_id>`.
TINKER_RESTORED_ID = re.compile(r"^.+:train:[0-9]+$")


def tinker_model_hint(name: str) -> str:
    """For a name that is a Tinker model id of a model opened from a checkpoint: where its run is."""
    if not TINKER_RESTORED_ID.fullmatch(name):
        return ""
    return ("; it is the id the tinker SDK gives a model opened from a checkpoint "
            "(create_training_client_from_state), whose run is named tinker-<n>-<hex>: `tandem status` "
            f"lists the runs, and the Tinker service's log names the pair (tinker.create_model model_id={name} run=...)")


#: A hub id: `org/name`, letters, digits, '_', '.', '-'.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def missing_model_directory(model: str) -> bool:
    """Whether `model` can only be a local directory (neither a hub id, `org/name`, nor a bare name)
    and there is none: a hub client would answer with its complaint about repo ids."""
    local = not (HUB_ID.fullmatch(model) or re.fullmatch(r"[A-Za-z0-9][\w.-]*", model))
    return local and not Path(model).expanduser().is_dir()


def _forms(model: str) -> set[str]:
    """What a model reference can be compared by: itself normalised, and its real path when it
    is a path that exists here."""
    norm = os.path.normpath(model.strip())
    forms = {norm}
    if os.path.exists(norm):
        forms.add(os.path.realpath(norm))
    return forms


def _copy_of(hub_id: str, path: str) -> bool:
    """True when `path` is a local copy of hub model `hub_id`: a directory `.../org/name`, or a
    snapshot in the Hugging Face cache (`.../models--org--name/snapshots/<rev>`)."""
    if not HUB_ID.fullmatch(hub_id) or not path.startswith(("/", ".", "~")):
        return False
    org, name = hub_id.split("/")
    parts = PurePosixPath(os.path.normpath(path)).parts
    return parts[-2:] == (org, name) or f"models--{org}--{name}" in parts


def same_base_model(wanted: str, engine_model: str, served_name: str | None = None) -> bool:
    """Whether a run's `base_model` names the model the engine serves.

    The engine reports its model (the hub id or local path it was started with) and the name it
    serves it under. `wanted` matches when it equals either (paths compared normalised, and by
    their real path where they exist on this machine), or when one of `wanted` and the engine's
    model is a hub id and the other a local copy of it (`/models/Qwen/Qwen2.5-0.5B`, or a snapshot
    in the Hugging Face cache). Two different local paths, or two different hub ids, never match.
    """
    served = {engine_model, *([served_name] if served_name else [])}
    if any(_forms(wanted) & _forms(s) for s in served):
        return True
    return _copy_of(wanted, engine_model) or _copy_of(engine_model, wanted)


#: An engine-side adapter name: `<run>-v<version>`, then `-a<attempt>` from the second attempt on.
ADAPTER_NAME = re.compile(r"^(?P<run>.+)-v(?P<version>[0-9]+)(?:-a(?P<attempt>[0-9]+))?$")


def adapter_name(run: str, version: int, attempt: int = 0) -> str:
    """Engine-side name of one attempt to load a version: unique, never reused, no ':'.

    The first attempt is `<run>-v<version>`; a later one (after a refused or timed-out load, or
    an engine that lost the adapter) is `<run>-v<version>-a<attempt>`, since a name the engine
    was ever given is never given again. A run name may hold '.', which peft refuses in adapter
    names: tandem's CPU engine registers each adapter with peft under a name of its own.
    """
    return f"{run}-v{version}" if attempt == 0 else f"{run}-v{version}-a{attempt}"


def parse_adapter_name(name: str) -> tuple[str, int, int] | None:
    """(run, version, attempt) of a name `adapter_name` made; None for any other name."""
    m = ADAPTER_NAME.fullmatch(name)
    if m is None or not RUN_NAME.fullmatch(m.group("run")):
        return None
    return m.group("run"), int(m.group("version")), int(m.group("attempt") or 0)


class _Strict(BaseModel):
    # inf and NaN are refused by name: JSON has no spelling for them (pydantic would store null,
    # and the stored spec would no longer read back)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LoraConfig(_Strict):
    """Shape of the LoRA adapter (plain LoRA, so SGLang loads it as it is)."""

    r: int = Field(16, ge=1, le=1024, strict=True)
    """Rank."""
    alpha: float = Field(32.0, gt=0, le=65536)
    """Scale numerator: the update is scaled by alpha / r (rslora is never used); at most 65536."""
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
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.99)
    """Adam betas, each in [0, 1)."""
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
    normalize_std: bool = Field(True, strict=True)
    """Divide group advantages by the group's reward std (GRPO); False keeps mean-centering only."""
    epochs: int = Field(1, ge=1, le=16, strict=True)
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
    max_staleness_steps: int = Field(1, ge=0, le=64, strict=True)
    """How many versions older than the parent of the version being trained a rollout may be."""
    seed: int = Field(0, ge=-(2**63), lt=2**63, strict=True)
    """Seed of the LoRA initialisation (a 64-bit signed integer)."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_run_name(v)

    @model_validator(mode="after")
    def _base(self) -> RunSpec:
        if not self.base_model.strip():
            raise ValueError("base_model is empty; give a hub id or a local path")
        return self


def stored_run(raw: bytes | str | None) -> str | None:
    """The run a stored JSON object names in its `run` field (a job's rq meta, a gateway episode);
    None for anything else: missing, not JSON, not an object, or a `run` that is no string."""
    if raw is None:
        return None
    try:
        stored = json.loads(raw)
    except ValueError:
        return None
    run = stored.get("run") if isinstance(stored, dict) else None
    return run if isinstance(run, str) else None
