"""What a train job needs from the model runtime, whichever runtime it is.

The jobs (jobs/) and the loss (grpo.py) are the same whatever runs the model;
the backend owns the model: it loads the base once and keeps it resident across jobs,
switches the LoRA adapter to a run's version (fresh for version 0, else weights and
optimizer state from the version directory, or from memory when the run is resident:
resident.py), computes per-token logprobs, steps the optimizer and writes plain PEFT files
that SGLang and the transformers engine both load.

Two backends: `peft` (transformers + peft, CPU or CUDA) and `unsloth` (CUDA only, Unsloth's
fused LoRA kernels); select.py picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import JsonValue

from tandem.runs import RunSpec

if TYPE_CHECKING:
    import torch

    from tandem_trainer.adapter_files import StagedAdapter
    from tandem_trainer.backends.resident import ResidentStats
    from tandem_trainer.microbatch import MicroBatch

#: File names inside a version's `adapter/` (what engines load) and `trainer/` (resume state).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_STATE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
MASTER_WEIGHTS = "lora_master.safetensors"  # the weights in the dtype they train in (the adapter may be narrower)


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about a base model, read from its config."""

    base_model: str
    vocab_size: int
    """Token ids must be below this."""
    max_positions: int
    """Longest prompt + completion the model can attend over (max_position_embeddings)."""
    pad_id: int
    turn_start_id: int | None = None
    """The chat template's token that opens each message (`<|im_start|>`); None: not known."""
    turn_start: str = ""
    """That token's text, for messages."""


@dataclass
class Forward:
    """Per-token outputs of the policy for one micro-batch, aligned with `MicroBatch.targets`."""

    logprobs: torch.Tensor
    """[B, W] float32, differentiable with respect to the LoRA parameters."""
    entropy: torch.Tensor | None = None
    """[B, W] float32 without grad, when asked for."""


class Backend(ABC):
    """A model runtime that trains one LoRA adapter at a time on a resident base model."""

    name: str = "abstract"
    device: torch.device
    """Where micro-batches must be moved before forward()."""

    @abstractmethod
    def model_info(self, base_model: str) -> ModelInfo:
        """Vocab size and context length of `base_model` (cheap: the config only)."""

    @abstractmethod
    def activate(self, spec: RunSpec, version: int, version_dir: Path | None) -> bool:
        """Make the run's adapter at `version` the one that trains.

        Version 0 (`version_dir` None) is a fresh LoRA seeded by `spec.seed` with a fresh
        optimizer; later versions load `version_dir/adapter` and `version_dir/trainer`.
        Returns False when the adapter in memory already was that version (nothing loaded).
        """

    @abstractmethod
    def forward(self, batch: MicroBatch, *, entropy: bool = False) -> Forward:
        """Logprobs of `batch.targets` under the current adapter, with grad."""

    @abstractmethod
    def reference_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        """Logprobs of `batch.targets` with the adapter disabled (the base model), no grad."""

    @abstractmethod
    def step(self, max_grad_norm: float) -> float:
        """Clip the accumulated gradient, take one optimizer step, zero the gradient.

        Returns the gradient norm before clipping.
        """

    # gradients held across jobs (the Tinker kinds: forward_backward, then optim_step) --------
    @abstractmethod
    def gradient_jobs(self) -> list[str]:
        """The jobs whose gradients the active adapter holds, accumulated and not yet applied, in
        the order they were accumulated. They stay with the run: a switch to another run sets them
        aside with its weights (resident.py) and a switch back restores them; `step`, `invalidate`,
        `drop_gradients` and a new version of the run replacing the adapter end them."""

    @abstractmethod
    def hold_gradients(self, job_id: str) -> None:
        """Record that the gradients just accumulated on the active adapter are job `job_id`'s."""

    @abstractmethod
    def drop_gradients(self, why: str) -> list[str]:
        """Zero the active adapter's gradients and forget their jobs, logging `why` when there were
        any; returns the jobs dropped."""

    @abstractmethod
    def set_adam(self, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """Set the active optimizer's hyper-parameters for the next `step` (its moments stay)."""

    @abstractmethod
    def reset_optimizer(self) -> None:
        """Forget the active optimizer's state (its moments and step count): a fresh optimizer."""

    @abstractmethod
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The active adapter's trainable parameters, in a fixed order (what data-parallel ranks
        sum the gradients of)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on the CPU): call before reading a clock."""

    @abstractmethod
    def stage_adapter(self) -> StagedAdapter:
        """Copy the adapter to host memory in the adapter's dtype, waiting for the copies; the
        StagedAdapter writes adapter_config.json + adapter_model.safetensors (what engines
        load) without the device. Valid until the next call."""

    @abstractmethod
    def save_state(self, trainer_dir: Path, *, trainer_state: dict[str, JsonValue]) -> None:
        """Write the optimizer state and `trainer_state` (what resuming from the version needs)."""

    @abstractmethod
    def mark_active(self, run: str, version: int, version_dir: Path) -> None:
        """Record that the adapter in memory now is `run` at `version`, published in `version_dir`.

        The directory is part of what the cache compares, so two stores never share an entry.
        """

    @abstractmethod
    def invalidate(self) -> None:
        """Forget which version is in memory (after a step that was not published), and every run
        kept in memory besides: the next switch to any run reads the store."""

    def forget_run(self, run: str) -> bool:
        """Forget everything held of a deleted run: its weights and optimizer state in memory (training
        or set aside) and the gradients it held; False when nothing was held. A backend that keeps no
        runs aside forgets the one in memory (`invalidate`) when it is that run's."""
        if self.active is not None and self.active[0] == run:
            self.invalidate()
            return True
        return False

    @property
    @abstractmethod
    def active(self) -> tuple[str, int] | None:
        """(run, version) of the adapter in memory, if it equals a published version."""

    def holds(self, run: str, version: int, version_dir: Path) -> bool:
        """Whether `run` at `version` (published in `version_dir`) is in memory, training or set
        aside: switching to it reads nothing from the store."""
        return self.active == (run, version)

    def resident_stats(self) -> ResidentStats | None:
        """The runs kept in memory, for /metrics (resident.py); None: this backend keeps none."""
        return None
