"""The GRPO loss: advantages, clipping, masks, KL and metrics, on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from tandem_trainer.grpo import (
    LossStats,
    group_advantages,
    grpo_loss,
    mean_std,
    reward_stats,
    selective_logprobs,
    token_entropy,
)

CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def test_group_advantages_are_normalised_within_the_group() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    adv = group_advantages(rewards)
    std = math.sqrt(1.25)  # population std of 1..4
    assert torch.allclose(adv, torch.tensor([-1.5, -0.5, 0.5, 1.5]) / std, atol=1e-5)
    assert abs(float(adv.mean())) < 1e-6
    assert abs(float(adv.std(unbiased=False)) - 1.0) < 1e-4
    centered = group_advantages(rewards, normalize_std=False)
    assert torch.allclose(centered, torch.tensor([-1.5, -0.5, 0.5, 1.5]))


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 1e6])
def test_group_with_equal_rewards_has_zero_advantages(value: float) -> None:
    adv = group_advantages(torch.full((5,), value))
    assert torch.equal(adv, torch.zeros(5))  # exactly zero, not rounding noise / eps


def test_group_of_two_gets_plus_and_minus_one() -> None:
    assert torch.allclose(group_advantages(torch.tensor([0.0, 1.0])), torch.tensor([-1.0, 1.0]), atol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 1e3, 1e160, 1e307])
def test_advantages_do_not_depend_on_the_rewards_scale_up_to_the_largest_finite(scale: float) -> None:
    rewards = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64) * scale  # from 1e155 on the squares overflow
    adv = group_advantages(rewards)
    assert torch.isfinite(adv).all()
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]) * math.sqrt(1.5), atol=1e-4)


def test_reward_statistics_are_finite_for_any_finite_rewards() -> None:
    assert reward_stats([1e308, 1.7e308, -1e308]) == pytest.approx(
        {"reward_mean": 5.6666667e307, "reward_std": 1.1440668e308}, rel=1e-6)
    assert reward_stats([2.0, 4.0]) == {"reward_mean": 3.0, "reward_std": 1.0}
    assert mean_std([]) == (0.0, 0.0) and mean_std([0.0, 0.0]) == (0.0, 0.0)


def test_unnormalised_advantages_beyond_float32_are_inf_for_the_job_to_refuse() -> None:
    assert torch.equal(group_advantages(torch.tensor([1e200, 0.0], dtype=torch.float64), normalize_std=False),
                       torch.tensor([math.inf, -math.inf]))
    assert torch.allclose(group_advantages(torch.tensor([1e30, 0.0], dtype=torch.float64), normalize_std=False),
                          torch.tensor([5e29, -5e29]))


def _grad(logprob: float, rollout: float, advantage: float) -> float:
    lp = torch.tensor([[logprob]], requires_grad=True)
    terms = grpo_loss(lp, torch.tensor([[rollout]]), torch.tensor([advantage]), torch.ones(1, 1), **CLIP)
    terms.loss.backward()
    assert lp.grad is not None
    return float(lp.grad)


def test_ratio_inside_the_band_gets_the_policy_gradient() -> None:
    # ratio = 1: d(-ratio * A)/d logprob = -A
    assert _grad(-1.0, -1.0, 2.0) == pytest.approx(-2.0)
    assert _grad(-1.0, -1.0, -3.0) == pytest.approx(3.0)


def test_ratio_above_the_band_with_positive_advantage_gets_no_gradient() -> None:
    assert _grad(math.log(1.5), 0.0, 1.0) == 0.0  # 1.5 > 1 + 0.28: clipped
    assert _grad(math.log(1.2), 0.0, 1.0) == pytest.approx(-1.2)  # inside the wider upper band


def test_ratio_below_the_band_with_negative_advantage_gets_no_gradient() -> None:
    assert _grad(math.log(0.7), 0.0, -1.0) == 0.0  # 0.7 < 1 - 0.2: clipped


def test_clip_never_blocks_the_correcting_direction() -> None:
    # Positive advantage but the token became unlikely: still pushed up (min picks unclipped).
    assert _grad(math.log(0.5), 0.0, 1.0) == pytest.approx(-0.5)
    # Negative advantage but the token became likely: still pushed down.
    assert _grad(math.log(2.0), 0.0, -1.0) == pytest.approx(2.0)


def test_clip_fraction_counts_tokens_where_the_clip_binds() -> None:
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 0.7, 0.5]]))
    advantages = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    terms = grpo_loss(logprobs, torch.zeros(1, 4), advantages, torch.ones(1, 4), **CLIP)
    assert terms.sums["clipped"] == 2.0  # 1.5 with A>0 and 0.7 with A<0; 0.5 with A>0 is not clipped
    assert terms.sums["ratio"] == pytest.approx(1.5 + 1.0 + 0.7 + 0.5)


def test_masked_tokens_contribute_nothing() -> None:
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    base = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    rollout = torch.tensor([[-1.1, -2.0, -0.4]])
    adv = torch.tensor([1.0])
    terms = grpo_loss(base, rollout, adv, mask, **CLIP)
    terms.loss.backward()
    assert base.grad is not None and base.grad[0, 1] == 0.0 and base.grad[0, 0] != 0.0

    changed = torch.tensor([[-1.0, -9.0, -0.5]])  # wild values only where the mask is 0
    wild_rollout = torch.tensor([[-1.1, -0.01, -0.4]])
    other = grpo_loss(changed, wild_rollout, adv, mask, **CLIP)
    assert float(other.loss) == pytest.approx(float(terms.loss.detach()))
    assert other.sums["tokens"] == 2.0


def test_loss_is_a_per_token_mean_over_the_job() -> None:
    # ratio 1 everywhere, advantage 1: every trained token contributes -1.
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    lp = torch.zeros(2, 4)
    terms = grpo_loss(lp, lp, torch.ones(2), mask, **CLIP)
    assert float(terms.loss.detach()) == pytest.approx(-1.0)  # 5 tokens, not the mean of 2 sequence means
    half = grpo_loss(lp, lp, torch.ones(2), mask, normalizer=10.0, **CLIP)
    assert float(half.loss) == pytest.approx(-0.5)


def test_kl_to_reference_is_k3_and_pulls_towards_it() -> None:
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    zero_adv = torch.zeros(1)
    terms = grpo_loss(lp, lp.detach(), zero_adv, torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.5, **CLIP)
    d = 0.5  # ref - logprob on the second token
    k3 = math.exp(d) - d - 1
    assert terms.sums["ref_kl"] == pytest.approx(k3)
    assert float(terms.loss.detach()) == pytest.approx(0.5 * k3 / 2)
    terms.loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 0] == pytest.approx(0.0)  # equal to the reference: no pull
    assert lp.grad[0, 1] < 0  # below the reference: the loss falls as the logprob rises

    no_kl = grpo_loss(lp.detach(), lp.detach(), zero_adv, torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.0,
                      **CLIP)
    assert float(no_kl.loss) == 0.0 and "ref_kl" not in no_kl.sums


def test_approx_kl_to_rollout_policy_is_zero_on_policy_and_positive_off() -> None:
    lp = torch.tensor([[-1.0, -2.0]])
    on = grpo_loss(lp, lp, torch.ones(1), torch.ones(1, 2), **CLIP)
    off = grpo_loss(lp, lp + 0.3, torch.ones(1), torch.ones(1, 2), **CLIP)
    assert on.sums["approx_kl"] == pytest.approx(0.0)
    assert off.sums["approx_kl"] > 0


def test_stats_average_per_token_over_micro_batches() -> None:
    stats = LossStats()
    stats.add({"tokens": 2.0, "loss": -2.0, "clipped": 1.0, "ratio": 2.0, "approx_kl": 0.0})
    stats.add({"tokens": 6.0, "loss": 2.0, "clipped": 1.0, "ratio": 6.0, "approx_kl": 0.8, "entropy": 4.0})
    metrics = stats.metrics()
    assert metrics["loss"] == 0.0 and metrics["clip_frac"] == 0.25 and metrics["ratio_mean"] == 1.0
    assert metrics["approx_kl"] == pytest.approx(0.1) and metrics["entropy"] == 0.5
    assert reward_stats([0.0, 1.0]) == {"reward_mean": 0.5, "reward_std": 0.5}


def test_selective_logprobs_and_entropy_match_the_full_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selective_logprobs(logits, targets), expected, atol=1e-6)
    uniform = token_entropy(torch.zeros(1, 2, 8))
    assert torch.allclose(uniform, torch.full((1, 2), math.log(8)))


def test_each_row_is_read_at_its_own_temperature() -> None:
    """The policy is the temperature-scaled model (tandem.logprobs): row i's logits are divided by T_i."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    temperatures = torch.tensor([0.3, 0.7, 1.0])
    scaled = logits / temperatures[:, None, None]
    expected = torch.log_softmax(scaled, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selective_logprobs(logits, targets, temperatures), expected, atol=1e-5)
    assert torch.equal(selective_logprobs(logits, targets, torch.ones(3)), selective_logprobs(logits, targets))
    assert not torch.allclose(selective_logprobs(logits, targets, temperatures)[0], selective_logprobs(logits, targets)[0])
    entropy = token_entropy(logits, temperatures)
    assert torch.allclose(entropy, -(scaled.softmax(-1) * scaled.log_softmax(-1)).sum(-1), atol=1e-5)
