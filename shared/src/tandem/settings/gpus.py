"""Which GPUs each side uses (`TANDEM_GPUS__*`), read by both services from the same `.env`, and
the GPU hand-over of shared mode."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from tandem.settings.section import SECTION

#: What the engine can free for the trainer in shared mode.
ReleaseTag = Literal["kv_cache", "weights", "cuda_graph"]


def _default_release_tags() -> list[ReleaseTag]:
    return ["kv_cache"]


class GpuSettings(BaseModel):
    """Which GPUs each side uses; read by both services from the same `.env`."""

    model_config = SECTION

    mode: Literal["split", "shared", "cpu"] = "cpu"
    """split: disjoint GPUs for inference and training; shared: both on one GPU with a lease; cpu: no GPU."""
    inference: list[int] = Field(default_factory=lambda: [0])
    """GPU indices of the inference engine (split and shared mode)."""
    trainer: list[int] = Field(default_factory=lambda: [1])
    """GPU indices of the trainer (split mode; shared mode uses the inference GPU)."""
    lease_ttl_s: float = Field(60.0, gt=0, le=3600)
    """Shared mode: a GPU lease expires this long after its holder's last renewal, in seconds."""
    lease_wait_s: float = Field(600.0, gt=0)
    """Shared mode: how long the trainer waits for inference to hand the GPU over, in seconds."""
    release_tags: list[ReleaseTag] = Field(default_factory=_default_release_tags)
    """Shared mode: what the engine frees for the trainer. The KV cache is nearly all of it; adding
    `weights` makes SGLang keep a CPU copy of the base weights (--enable-weights-cpu-backup). None
    (`[]`): the engine keeps all of its memory and only stops serving while the trainer steps
    (not even that with `serve_while_training`), for a trainer that fits beside it; each hand-over
    then skips the release and the resume (vLLM's wake-up maps its KV cache again: 0.43 s of every
    policy sync at ~80 GiB, 9 ms at the 8 GiB of `engine.kv_cache_gib`'s shared-mode default)."""
    serve_while_training: bool = False
    """Shared mode with `release_tags` empty: go on serving while the trainer steps. There is no
    hand-over at all: the trainer takes no lease and the gateway never holds requests back; rollouts
    and training share the GPU's compute, each slower than alone, neither waiting for the other.
    It needs `release_tags=[]` (an engine that frees its memory cannot serve) and a trainer that
    fits beside the engine's memory (lower `engine.mem_fraction_static` to make room). Set it on
    both services alike (one `.env`; compose passes its SERVE_WHILE_TRAINING to both): a trainer
    that takes the lease from an inference side that does not lend it waits `lease_wait_s` for
    each job. Ignored in split and cpu mode, which always serve while training."""

    @property
    def leased(self) -> bool:
        """Whether the GPU changes hands for each training job (shared mode, unless it serves while training)."""
        return self.mode == "shared" and not self.serve_while_training

    @property
    def lends_memory(self) -> bool:
        """Whether the engine frees GPU memory for each training job (shared mode with release tags)."""
        return self.mode == "shared" and bool(self.release_tags)

    @model_validator(mode="after")
    def _serving_frees_nothing(self) -> GpuSettings:
        if self.mode == "shared" and self.serve_while_training and self.release_tags:
            raise ValueError(
                f"gpus.serve_while_training needs gpus.release_tags=[], but it is {self.release_tags}: an engine "
                "that frees its memory for the trainer cannot serve meanwhile; set release_tags to [] (for a "
                "trainer that fits beside the engine) or serve_while_training to false"
            )
        return self

    @model_validator(mode="after")
    def _disjoint(self) -> GpuSettings:
        if self.mode == "split":
            both = sorted(set(self.inference) & set(self.trainer))
            if both:
                raise ValueError(
                    f"split mode needs disjoint GPUs, but gpus.inference={self.inference} and "
                    f"gpus.trainer={self.trainer} share {both}; pick other GPUs or use mode 'shared'"
                )
            if not self.inference or not self.trainer:
                raise ValueError("split mode needs gpus.inference and gpus.trainer to name at least one GPU each")
        return self
