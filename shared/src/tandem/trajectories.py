"""Samples, completions, trajectories and groups: what rollouts produce and training consumes.

A sample keeps token ids, not text, so training sees exactly the tokens that were sampled
(re-tokenising text drifts). `rollout_logprobs` are the sampling policy's logprobs of each
completion token; the loss uses them for the importance ratio, which is what lets the policy
that sampled be older than the one training (their convention, the temperature-scaled model:
`tandem.logprobs`). A `Completion` is a sample as the gateway returns it (with its text); a
`Trajectory` is the same sample scored (its reward) and ready to train on, with `loss_mask`
marking which completion tokens are trained on (0 for tool output or user turns inside a
multi-turn completion).

A sample also keeps what sampled it (`origin`: the run and the adapter, as the gateway's `tandem`
extension reported them), so that a job of one run cannot train on another run's rollouts
(`tandem.jobs.check_origins`, on the client and again on the trainer). A sample without an
origin (built by hand, or by a client older than the field) is trained as any run's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.errors import invalid
from tandem.runs import check_run_name, parse_adapter_name


class Origin(BaseModel):
    """What sampled a completion, as the gateway's `tandem` extension reported it: the run whose
    version served the request and the engine's name of that version's adapter.

    `Origin(run=None)` marks the base model asked for by its own name (no run, no adapter): any
    run may train on it. The version is the sample's own `version`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str | None
    """The run whose version sampled it; None for the base model asked for by its own name."""
    adapter: str | None = None
    """The engine's name of that version's adapter (`<run>-v<version>`); None for version 0, the base model."""

    @field_validator("run")
    @classmethod
    def _run(cls, run: str | None) -> str | None:
        return None if run is None else check_run_name(run)

    @classmethod
    def of(cls, extension: Mapping[str, Any]) -> Origin | None:
        """The origin a gateway reply's `tandem` object reports (its `run` and `adapter`); None when
        it names no run at all (not tandem's gateway, or one older than the field)."""
        if "run" not in extension:
            return None
        return cls(run=extension["run"], adapter=extension.get("adapter"))

    def describe(self, version: int) -> str:
        """`run 'alpha' (v2)`, or `the base model` (for messages)."""
        return "the base model" if self.run is None else f"run {self.run!r} (v{version})"


class Sample(BaseModel):
    """The exact tokens of one sampled completion, their logprobs, and the version (and run) that sampled them."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int]
    """Token ids of the prompt (chat template applied)."""
    completion_ids: list[int]
    """Token ids the policy generated (and, in multi-turn, the masked-out turns between)."""
    rollout_logprobs: list[float]
    """Logprob of each completion token under the policy that sampled it."""
    version: int = Field(0, ge=0)
    """Adapter version that produced the completion (0 = base model)."""
    temperature: float = Field(1.0, gt=0, le=2)
    """The temperature whose distribution `rollout_logprobs` are under (`tandem.logprobs`: the
    sampling temperature, 1 for greedy); the trainer divides its logits by it."""
    origin: Origin | None = Field(None, exclude_if=lambda origin: origin is None)
    """What sampled it, as the gateway reported it; None when not known (then it is trained as any
    run's). Left out of the JSON when None, so a sample without one reads as it did before the field."""

    @model_validator(mode="after")
    def _origin_fits_version(self) -> Sample:
        origin = self.origin
        if origin is None:
            return self
        if origin.run is None and self.version != 0:
            raise ValueError(f"origin.run is None (the base model, version 0) but version is {self.version}; "
                             "give the run that sampled it")
        if origin.adapter is not None and self.version == 0:
            raise ValueError(f"origin.adapter is {origin.adapter!r} but version is 0, the base model, which "
                             "no adapter serves; give adapter None")
        if origin.adapter is not None:
            parsed = parse_adapter_name(origin.adapter)
            if parsed is None or parsed[:2] != (origin.run, self.version):
                raise ValueError(f"origin.adapter {origin.adapter!r} is not the adapter of "
                                 f"{origin.describe(self.version)}; keep the gateway's run, version and "
                                 "adapter together")
        return self


class Completion(Sample):
    """One sampled completion as the gateway returned it; score it to get a `Trajectory`."""

    model_config = ConfigDict(frozen=True)

    text: str = ""
    """The completion as text (what a reward function reads)."""
    finish_reason: str | None = None
    """Why sampling stopped: `stop`, `length`, or None when the gateway did not say."""

    @property
    def logprobs(self) -> list[float]:
        """`rollout_logprobs`, by its older name."""
        return self.rollout_logprobs

    def to_trajectory(self, reward: float, loss_mask: list[int] | None = None) -> Trajectory:
        """This completion with its reward, checked for training; ValidationFailed names what breaks."""
        try:
            return Trajectory(prompt_ids=self.prompt_ids, completion_ids=self.completion_ids,
                              rollout_logprobs=self.rollout_logprobs, version=self.version,
                              temperature=self.temperature, origin=self.origin, reward=reward,
                              loss_mask=loss_mask)
        except ValidationError as exc:
            raise invalid("this completion cannot be trained on", exc) from exc


class Trajectory(Sample):
    """One sampled completion, its reward, and the version that produced it: what training reads."""

    prompt_ids: list[int] = Field(min_length=1)
    """Token ids of the prompt (chat template applied)."""
    completion_ids: list[int] = Field(min_length=1)
    """Token ids the policy generated (and, in multi-turn, the masked-out turns between)."""
    loss_mask: list[int] | None = None
    """1 for tokens to train on, 0 to skip; default all ones."""
    reward: float
    """Scalar reward."""

    @field_validator("reward", mode="before")
    @classmethod
    def _a_number(cls, reward: Any) -> Any:
        """A number: pydantic would read "1" and True as 1.0, a reward function's bug taken for a score."""
        if isinstance(reward, (bool, str, bytes)):
            raise ValueError(f"reward {reward!r:.60} is a {type(reward).__name__}; give a number (a float or an int; "
                             "numpy scalars work)")
        return reward

    @field_validator("loss_mask")
    @classmethod
    def _something_to_train(cls, mask: list[int] | None) -> list[int] | None:
        if mask is not None and mask and not any(mask):
            raise ValueError(
                f"every one of its {len(mask)} entries is 0, so no token of this completion would be "
                "trained on; mark the tokens the model sampled with 1 (or leave loss_mask out)"
            )
        return mask

    @model_validator(mode="after")
    def _consistent(self) -> Trajectory:
        n = len(self.completion_ids)
        if len(self.rollout_logprobs) != n:
            raise ValueError(
                f"rollout_logprobs has {len(self.rollout_logprobs)} entries but completion_ids "
                f"has {n}; give one logprob per completion token"
            )
        if self.loss_mask is not None:
            if len(self.loss_mask) != n:
                raise ValueError(
                    f"loss_mask has {len(self.loss_mask)} entries but completion_ids has {n}"
                )
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError("loss_mask must hold only 0 and 1")
        if not math.isfinite(self.reward):
            raise ValueError(f"reward is {self.reward}; rewards must be finite numbers")
        if any(not math.isfinite(lp) or lp > 1e-4 for lp in self.rollout_logprobs):
            raise ValueError("rollout_logprobs must be finite and <= 0")
        if any(t < 0 for t in self.prompt_ids) or any(t < 0 for t in self.completion_ids):
            raise ValueError("token ids must be >= 0")
        return self

    @property
    def mask(self) -> list[int]:
        """The loss mask with its default filled in."""
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.completion_ids)


class TrajectoryGroup(BaseModel):
    """Completions of one prompt, compared with each other for group-normalised advantages."""

    model_config = ConfigDict(extra="forbid")

    trajectories: list[Trajectory]

    @model_validator(mode="after")
    def _at_least_two(self) -> TrajectoryGroup:
        if len(self.trajectories) < 2:
            raise ValueError(
                f"a group has {len(self.trajectories)} trajectory; GRPO compares completions "
                "of one prompt, so give each group at least 2"
            )
        return self

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]
