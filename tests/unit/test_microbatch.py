"""Micro-batching: the padded-token budget holds, and accumulation equals one big batch."""

from __future__ import annotations

import random

import pytest
import torch

from tandem_trainer.grpo import grpo_loss, selective_logprobs
from tandem_trainer.microbatch import Sample, accumulation_weights, build_microbatches, collate, pack


def test_pack_respects_the_budget_and_keeps_every_sequence_once() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(3, 60) for _ in range(200)]
    groups = pack(lengths, budget=128)
    assert sorted(i for g in groups for i in g) == list(range(200))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 128
    assert len(groups) < 200  # it does pack several sequences together


def test_a_sequence_over_the_budget_gets_its_own_micro_batch() -> None:
    groups = pack([10, 500, 12, 9], budget=64)
    assert [1] in groups
    assert all(len(g) * max([10, 500, 12, 9][i] for i in g) <= 64 for g in groups if g != [1])


def test_collate_aligns_completion_tokens_with_their_predictions() -> None:
    samples = [
        Sample([1, 2, 3], [4, 5], [-0.1, -0.2], [1, 0], 0.5),
        Sample([6], [7, 8, 9], [-0.3, -0.4, -0.5], [1, 1, 1], -1.0),
    ]
    mb = collate(samples, [0, 1], pad_id=0)
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert mb.start == 0 and mb.logits_to_keep == 5
    # column k predicts token start + 1 + k
    assert mb.targets.tolist() == [[2, 3, 4, 5], [7, 8, 9, 0]]
    assert mb.mask.tolist() == [[0, 0, 1, 0], [1, 1, 1, 0]]
    assert mb.rollout_logprobs[0, 2:].tolist() == pytest.approx([-0.1, -0.2])
    assert mb.rollout_logprobs[1, :3].tolist() == pytest.approx([-0.3, -0.4, -0.5])
    assert mb.tokens == 4 and mb.advantages.tolist() == [0.5, -1.0]


class TinyLM(torch.nn.Module):
    """A causal toy LM: each position sees a running mean of the embeddings before it."""

    def __init__(self, vocab: int = 13, dim: int = 8) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)
        return self.head(torch.tanh(h))


def _job_loss(model: TinyLM, mb, weight: float) -> torch.Tensor:
    logits = model(mb.input_ids)[:, mb.start : -1]
    lp = selective_logprobs(logits, mb.targets)
    terms = grpo_loss(lp, mb.rollout_logprobs, mb.advantages, mb.mask, clip_low=0.2, clip_high=0.28)
    return terms.loss * weight


def test_accumulated_gradient_equals_the_full_batch_gradient() -> None:
    rng = random.Random(1)
    samples = []
    for _ in range(9):
        p, c = rng.randint(1, 6), rng.randint(1, 8)
        samples.append(Sample(
            [rng.randrange(13) for _ in range(p)], [rng.randrange(13) for _ in range(c)],
            [-rng.uniform(1.5, 3.5) for _ in range(c)], [rng.choice([0, 1, 1]) for _ in range(c)],
            rng.uniform(-1.5, 1.5),
        ))
    torch.manual_seed(0)
    model = TinyLM()

    full = collate(samples, list(range(len(samples))))
    _job_loss(model, full, 1.0).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    batches = build_microbatches(samples, budget=24)
    assert len(batches) >= 3
    assert all(mb.padded_tokens <= 24 or len(mb.indices) == 1 for mb in batches)
    weights = accumulation_weights([mb.tokens for mb in batches])
    assert sum(weights) == pytest.approx(1.0)
    for mb, w in zip(batches, weights, strict=True):
        if w:
            _job_loss(model, mb, w).backward()
    for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        assert got is not None
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def test_accumulation_weights_skip_empty_micro_batches() -> None:
    assert accumulation_weights([3, 0, 1]) == [0.75, 0.0, 0.25]
    assert accumulation_weights([0, 0]) == [0.0, 0.0]
