"""The GRPO loss in plain torch: group advantages, clipped importance ratio, KL, metrics.

GRPO has no value model: each completion's advantage is its reward compared with the other
completions of the same prompt. The policy gradient is weighted by the importance ratio of
the current policy to the policy that *sampled* the tokens (`rollout_logprobs`), clipped to
(1 - clip_low, 1 + clip_high) as in PPO, which is what lets rollouts come from a version a
few steps older than the one training (async mode, `max_staleness_steps`). The clip band is
asymmetric (DAPO's "clip higher"): a wider upper bound keeps low-probability tokens able to
grow. The loss is normalised per token over every trained token of the job (not per
sequence), so long completions are not down-weighted and micro-batching does not change it.

Nothing here knows about models or devices; the backend supplies logprobs, this module
turns them into a scalar loss and the numbers worth logging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.trajectories import TrajectoryGroup

#: Log-ratios are clamped to this magnitude before exp, so one wild token cannot make inf.
MAX_LOG_RATIO = 20.0


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of one group: reward minus the group mean, divided by the group std.

    The std is the population std (the group is the whole sample, not an estimate of a
    larger one). A group whose rewards are all equal carries no signal about which
    completion is better, so it gets exactly zero advantages instead of rounding noise
    divided by eps.

    Computed on the rewards divided by their largest magnitude, which changes nothing (the std and
    eps are scaled alike) but keeps any finite rewards from overflowing: 1e308 sums to inf. Without
    `normalize_std` the advantages are the rewards' own scale, so ones beyond float32 come back as
    inf (the job refuses them, naming the group).
    """
    unit, scale = _unit(rewards)
    if scale == 0.0:
        return torch.zeros_like(rewards, dtype=torch.float32)
    centered = unit - unit.mean()
    std = float(unit.std(unbiased=False))
    if std < eps / scale:
        return torch.zeros_like(rewards, dtype=torch.float32)
    if normalize_std:
        return (centered / (std + eps / scale)).to(torch.float32)
    return (centered * scale).to(torch.float32)


def selective_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """log p(target) for each position, without materialising a full log-softmax.

    `logits` is [B, W, V], `targets` [B, W]; returns float32 [B, W]. `temperatures` [B] (None: all
    1) divides each row's logits first: the policy is the temperature-scaled model, as the
    engines' rollout logprobs are (`tandem.trajectories`). Row by row, so peak memory is one
    sequence's logits in float32 rather than the whole batch's.
    """
    rows = []
    for i, (row_logits, row_targets) in enumerate(zip(logits, targets, strict=True)):
        row_logits = _scaled(row_logits, temperatures, i)
        picked = row_logits.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the (temperature-scaled) next-token distribution at each position, [B, W] (a metric, no grad)."""
    rows = []
    for i, row_logits in enumerate(logits):
        logp = torch.log_softmax(_scaled(row_logits, temperatures, i), dim=-1)
        rows.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(rows)


def _scaled(row_logits: torch.Tensor, temperatures: torch.Tensor | None, i: int) -> torch.Tensor:
    row_logits = row_logits.float()
    if temperatures is None:
        return row_logits
    return row_logits / temperatures[i].to(row_logits)


@dataclass
class LossTerms:
    """The loss of one micro-batch and the masked sums its metrics are made of."""

    loss: torch.Tensor
    """Scalar to call backward() on: this micro-batch's share of the job's per-token loss."""
    totals: dict[str, torch.Tensor]
    """The masked sums as 0-d tensors on the loss's device: reading them is left to the caller,
    once per step, so that a step does not wait for the device after every micro-batch."""

    @property
    def sums(self) -> dict[str, float]:
        """The masked sums as numbers (waits for the device)."""
        return {key: float(value) for key, value in self.totals.items()}


def grpo_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    normalizer: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossTerms:
    """Token-level PPO-clipped policy loss, plus `kl_coef` times the k3 KL to the reference.

    Shapes: `logprobs`, `rollout_logprobs`, `mask` and `ref_logprobs` are [B, W];
    `advantages` is [B] (one per sequence) or [B, W]. `mask` is 1 on trained tokens.
    `normalizer` is the number of trained tokens in the whole job (every micro-batch), so
    summing the returned losses over micro-batches gives the job's mean per-token loss;
    left out, it is this micro-batch's own token count.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)
    tokens = mask.sum()
    scale: float | torch.Tensor = tokens.clamp(min=1.0) if normalizer is None else normalizer

    log_ratio = (logprobs - rollout_logprobs.to(logprobs.dtype)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)

    sums: dict[str, torch.Tensor] = {}
    if ref_logprobs is not None and kl_coef > 0:
        ref_log_ratio = (ref_logprobs.to(logprobs.dtype) - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ref_kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0  # k3: unbiased, always >= 0
        per_token = per_token + kl_coef * ref_kl
        sums["ref_kl"] = (ref_kl.detach() * mask).sum()

    loss = (per_token * mask).sum() / scale
    with torch.no_grad():
        ratio_d = ratio.detach()
        is_clipped = ((advantages > 0) & (ratio_d > 1.0 + clip_high)) | (
            (advantages < 0) & (ratio_d < 1.0 - clip_low)
        )
        sums.update(
            tokens=tokens,
            loss=(per_token.detach() * mask).sum(),
            clipped=(is_clipped.to(mask.dtype) * mask).sum(),
            ratio=(ratio_d * mask).sum(),
            # k3 estimate of KL(rollout || current) on tokens the rollout policy sampled.
            approx_kl=((ratio_d - 1.0 - log_ratio.detach()) * mask).sum(),
        )
    return LossTerms(loss=loss, totals=sums)


@dataclass
class LossStats:
    """Running masked sums over every micro-batch (and epoch) of a job, turned into metrics."""

    sums: dict[str, float] = field(default_factory=dict)

    def add(self, sums: dict[str, float]) -> None:
        for key, value in sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value

    def metrics(self) -> dict[str, float]:
        """Per-token means: loss, clip_frac, approx_kl, ratio_mean, and ref_kl/entropy when measured."""
        tokens = max(self.sums.get("tokens", 0.0), 1.0)
        out = {
            "loss": self.sums.get("loss", 0.0) / tokens,
            "clip_frac": self.sums.get("clipped", 0.0) / tokens,
            "approx_kl": self.sums.get("approx_kl", 0.0) / tokens,
            "ratio_mean": self.sums.get("ratio", 0.0) / tokens,
        }
        for key in ("ref_kl", "entropy"):
            if key in self.sums:
                out[key] = self.sums[key] / tokens
        return out


def _unit(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`values` in float64 divided by their largest magnitude, and that magnitude (0: all zero or
    none, and the values as they are): sums and squares of them cannot overflow."""
    values = values.to(torch.float64)
    scale = float(values.abs().max()) if values.numel() else 0.0
    return (values / scale if scale else values), scale


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population std, computed on the values divided by the largest magnitude: finite
    for any finite values (the sum of two 1e308 is not)."""
    unit, scale = _unit(torch.tensor(values, dtype=torch.float64))
    if scale == 0.0:
        return 0.0, 0.0
    return float(unit.mean()) * scale, float(unit.std(unbiased=False)) * scale


def reward_stats(rewards: list[float]) -> dict[str, float]:
    """Mean and (population) std of the job's rewards."""
    mean, std = mean_std(rewards)
    return {"reward_mean": mean, "reward_std": std}


def rollout_stats(groups: Sequence[TrajectoryGroup], parent: int) -> dict[str, float]:
    """What a step's rollouts were: the mean of the groups' reward stds (the signal GRPO sees; 0
    when every group is flat), and the versions that sampled them, against `parent`, the version
    the step trains from (staleness: how many versions older a rollout is)."""
    stds = [mean_std(g.rewards)[1] for g in groups]
    versions = [t.version for g in groups for t in g.trajectories]
    staleness = [parent - v for v in versions]
    return {
        "reward_group_std": mean_std(stds)[0],
        "rollout_version_min": float(min(versions)), "rollout_version_max": float(max(versions)),
        "staleness_mean": sum(staleness) / len(staleness), "staleness_max": float(max(staleness)),
    }
