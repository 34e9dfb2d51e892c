"""Packing a job's sequences into micro-batches that fit a padded-token budget.

A job may hold more tokens than fit in memory at once, so its sequences are split into
micro-batches whose padded size (rows x longest row) stays within
`backend.micro_batch_tokens`, and gradients accumulate across them. Sorting by length
before packing keeps padding small. The accumulation weights make the sum over
micro-batches equal to one big batch's per-token mean, so the micro-batch budget is a
memory knob only and never changes what is learned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Sample:
    """One trajectory as the loss sees it: tokens, rollout logprobs, loss mask, advantage, and the
    temperature its logprobs are under (the policy is the temperature-scaled model)."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    rollout_logprobs: Sequence[float]
    mask: Sequence[int]
    advantage: float
    temperature: float = 1.0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def trained_tokens(self) -> int:
        return int(sum(self.mask))


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded tensors of a few samples, plus what the loss needs per completion token.

    Logits are only needed from position `start` on (the last prompt token of the shortest
    prompt), so the backend asks the model for the last `logits_to_keep` positions and the
    per-token tensors are [B, W] with W = L - 1 - start: column k is the prediction of
    token `start + 1 + k`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    start: int
    targets: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    temperatures: torch.Tensor
    """[B]: each row's sampling temperature; the logits are divided by it before the log-softmax."""
    indices: tuple[int, ...]
    """Positions of these samples in the job's sample list."""

    @property
    def logits_to_keep(self) -> int:
        return int(self.input_ids.shape[1]) - self.start

    @property
    def tokens(self) -> int:
        """Trained (masked-in) completion tokens."""
        return int(self.mask.sum())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            targets=self.targets.to(device),
            mask=self.mask.to(device),
            rollout_logprobs=self.rollout_logprobs.to(device),
            advantages=self.advantages.to(device),
            temperatures=self.temperatures.to(device),
        )


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group indices so that each group's rows x longest row <= `budget`.

    Longest first, filled greedily: within a group every row is padded to the first
    (longest) one. A sequence longer than the budget on its own gets a group of its own
    (it cannot be split without changing the loss).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def collate(samples: Sequence[Sample], indices: Sequence[int], *, pad_id: int = 0) -> MicroBatch:
    """Right-pad `samples[i] for i in indices` into one MicroBatch."""
    chosen = [samples[i] for i in indices]
    width = max(s.length for s in chosen)
    start = min(len(s.prompt_ids) for s in chosen) - 1
    n = len(chosen)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    w = width - 1 - start
    mask = torch.zeros((n, w), dtype=torch.float32)
    rollout = torch.zeros((n, w), dtype=torch.float32)
    for row, s in enumerate(chosen):
        ids = list(s.prompt_ids) + list(s.completion_ids)
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
        # completion token j sits at position p + j and is predicted at column p + j - 1 - start
        first = len(s.prompt_ids) - 1 - start
        span = slice(first, first + len(s.completion_ids))
        mask[row, span] = torch.tensor(list(s.mask), dtype=torch.float32)
        rollout[row, span] = torch.tensor(list(s.rollout_logprobs), dtype=torch.float32)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        start=start,
        targets=input_ids[:, start + 1 :].clone(),
        mask=mask,
        rollout_logprobs=rollout,
        advantages=torch.tensor([s.advantage for s in chosen], dtype=torch.float32),
        temperatures=torch.tensor([s.temperature for s in chosen], dtype=torch.float32),
        indices=tuple(indices),
    )


def split_budget(lengths: Sequence[int], budget: int, ranks: int) -> int:
    """The micro-batch budget when `ranks` processes share a job: small enough that each rank
    gets some of the job (about its total over `ranks`), never above `budget`, never below the
    longest sequence (which cannot be split). One rank keeps `budget`."""
    if ranks <= 1 or not lengths:
        return budget
    return min(budget, max(max(lengths), -(-sum(lengths) // ranks)))


def build_microbatches(samples: Sequence[Sample], budget: int, *, pad_id: int = 0) -> list[MicroBatch]:
    """Pack and collate every sample of a job."""
    return [collate(samples, group, pad_id=pad_id) for group in pack([s.length for s in samples], budget)]


def accumulation_weights(token_counts: Sequence[int]) -> list[float]:
    """Weight of each micro-batch's per-token mean loss in the job's per-token mean.

    sum_i w_i * mean_i = sum_i (n_i / N) * (S_i / n_i) = (sum_i S_i) / N: exactly the
    mean over all N tokens of one big batch. A micro-batch with no trained tokens weighs 0.
    """
    total = sum(token_counts)
    if total <= 0:
        return [0.0 for _ in token_counts]
    return [n / total for n in token_counts]
