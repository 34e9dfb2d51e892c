"""Tinker's losses against numbers worked by hand, and the checks of a forward_backward's input.

No model, no Redis: small tensors. Where a ratio is needed, the target log-probabilities are
ln 2 and ln 0.5 against sampling log-probabilities of 0, so the ratios are 2 and 0.5 exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.errors import ValidationFailed
from tandem.tinker_jobs import Datum, ForwardBackwardJob, LossName
from tandem_trainer.errors import JobRejected
from tandem_trainer.jobs.kinds import FORWARD_BACKWARD
from tandem_trainer.tinker_losses import check_datums, datum_loss, loss_config

pytestmark = pytest.mark.unit

LN2 = math.log(2.0)


def loss_and_grad(loss_fn: LossName, target: list[float], inputs: dict[str, list[float]],
                  config: dict[str, float] | None = None) -> tuple[float, list[float]]:
    lp = torch.tensor(target, dtype=torch.float64, requires_grad=True)
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}
    loss = datum_loss(loss_fn, lp, tensors, loss_config(loss_fn, config or {}))
    loss.backward()
    assert lp.grad is not None
    return float(loss.detach()), lp.grad.tolist()


def test_cross_entropy_is_minus_the_weighted_sum_of_the_target_logprobs() -> None:
    # -(-1*0 + -2*1 + -0.5*2) = 3; d/dlp = -weights
    loss, grad = loss_and_grad("cross_entropy", [-1.0, -2.0, -0.5], {"weights": [0.0, 1.0, 2.0]})
    assert loss == pytest.approx(3.0)
    assert grad == pytest.approx([0.0, -1.0, -2.0])


def test_importance_sampling_weighs_the_advantages_by_the_ratio() -> None:
    # ratios 2 and 0.5: -(2*1 + 0.5*3) = -3.5; d/dlp of -ratio*adv is -ratio*adv
    loss, grad = loss_and_grad("importance_sampling", [LN2, -LN2], {"logprobs": [0.0, 0.0], "advantages": [1.0, 3.0]})
    assert loss == pytest.approx(-3.5)
    assert grad == pytest.approx([-2.0, -1.5])


def test_ppo_takes_the_smaller_of_the_ratio_and_the_clipped_ratio_objectives() -> None:
    # positive advantages [1, 3]: token 0 min(2, 1.2) = 1.2 (clipped: no gradient), token 1 min(1.5, 2.4) = 1.5
    loss, grad = loss_and_grad("ppo", [LN2, -LN2], {"logprobs": [0.0, 0.0], "advantages": [1.0, 3.0]})
    assert loss == pytest.approx(-(1.2 + 1.5))
    assert grad == pytest.approx([0.0, -1.5])
    # negative advantages [-1, -1]: token 0 min(-2, -1.2) = -2 (unclipped), token 1 min(-0.5, -0.8) = -0.8 (clipped)
    loss, grad = loss_and_grad("ppo", [LN2, -LN2], {"logprobs": [0.0, 0.0], "advantages": [-1.0, -1.0]})
    assert loss == pytest.approx(2.8)
    assert grad == pytest.approx([2.0, 0.0])


def test_ppo_thresholds_come_from_the_loss_config() -> None:
    # bounds 0.4 and 2.5 clip neither ratio: the importance-sampling loss, -3.5
    config = {"clip_low_threshold": 0.4, "clip_high_threshold": 2.5}
    loss, _ = loss_and_grad("ppo", [LN2, -LN2], {"logprobs": [0.0, 0.0], "advantages": [1.0, 3.0]}, config)
    assert loss == pytest.approx(-3.5)
    assert loss_config("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def test_cispo_weighs_the_logprob_by_the_clipped_ratio_without_its_gradient() -> None:
    # clipped ratios 1.2 and 0.8: -(1.2*ln2*1 + 0.8*(-ln2)*3) = 1.2 ln2; d/dlp = -clipped*adv (the ratio detached)
    loss, grad = loss_and_grad("cispo", [LN2, -LN2], {"logprobs": [0.0, 0.0], "advantages": [1.0, 3.0]})
    assert loss == pytest.approx(1.2 * LN2)
    assert grad == pytest.approx([-1.2, -2.4])


def datum(n: int = 3, **inputs: list[float]) -> Datum:
    return Datum(tokens=list(range(1, n + 1)), inputs={"target_tokens": [5.0] * n, **inputs})


def rejected(datums: list[Datum], loss_fn: LossName = "ppo") -> JobRejected:
    with pytest.raises(JobRejected) as err:
        check_datums(datums, loss_fn, vocab_size=512, max_positions=64)
    return err.value


RL = {"logprobs": [-1.0] * 3, "advantages": [1.0] * 3}


def test_a_missing_input_names_the_datum_and_the_field() -> None:
    err = rejected([datum(**RL), datum(logprobs=[-1.0] * 3)])
    assert err.field == "datums.1.inputs.advantages"
    assert "needs loss_fn_inputs" in str(err) and "'advantages'" in str(err)
    assert rejected([datum()], "cross_entropy").field == "datums.0.inputs.weights"


def test_an_input_of_another_length_than_the_tokens_is_rejected() -> None:
    err = rejected([datum(**RL), datum(**{**RL, "advantages": [1.0, 2.0]})])
    assert err.field == "datums.1.inputs.advantages" and "2 values for 3 tokens" in str(err)
    err = rejected([Datum(tokens=[1, 2, 3], inputs={"target_tokens": [4.0], **RL})])
    assert err.field == "datums.0.inputs.target_tokens"


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"target_tokens": [5.0, 512.0, 5.0]}, "datums.0.inputs.target_tokens", "512.0 is not a token id"),
    ({"target_tokens": [5.0, 2.5, 5.0]}, "datums.0.inputs.target_tokens", "2.5 is not a token id"),
    ({"advantages": [1.0, math.nan, 1.0]}, "datums.0.inputs.advantages", "not a finite number"),
    ({"mask": [1.0, 1.0, 1.0]}, "datums.0.inputs.mask", "unknown loss_fn_input 'mask'"),
])
def test_bad_values_are_rejected_naming_the_field(change: dict[str, list[float]], field: str, words: str) -> None:
    err = rejected([Datum(tokens=[1, 2, 3], inputs={"target_tokens": [5.0] * 3, **RL, **change})])
    assert err.field == field and words in str(err)


def test_tokens_outside_the_vocabulary_or_the_context_are_rejected() -> None:
    assert rejected([Datum(tokens=[1, 600, 3], inputs={"target_tokens": [5.0] * 3, **RL})]).field == "datums.0.tokens"
    with pytest.raises(JobRejected, match="more than the model's 2 positions") as err:
        check_datums([datum(**RL)], "ppo", vocab_size=512, max_positions=2)
    assert err.value.field == "datums.0.tokens"


def test_the_loss_config_takes_only_its_losss_keys_and_sane_bounds() -> None:
    with pytest.raises(JobRejected, match="takes no keys") as err:
        loss_config("cross_entropy", {"clip_low_threshold": 0.9})
    assert err.value.field == "loss_fn_config.clip_low_threshold"
    with pytest.raises(JobRejected, match="clip_low_threshold <= clip_high_threshold"):
        loss_config("cispo", {"clip_low_threshold": 1.5})
    with pytest.raises(JobRejected) as err:
        loss_config("ppo", {"clip_eps": 0.2})
    assert err.value.field == "loss_fn_config.clip_eps"


def test_an_unknown_loss_or_an_empty_job_is_refused_by_the_payload_model() -> None:
    payload = ForwardBackwardJob(run="r", datums=[datum(**RL)], loss_fn="ppo").model_dump(mode="json")
    with pytest.raises(ValidationFailed) as err:
        FORWARD_BACKWARD.parse({**payload, "loss_fn": "dpo"})
    assert err.value.field == "loss_fn"
    with pytest.raises(ValidationFailed) as err:
        FORWARD_BACKWARD.parse({**payload, "datums": []})
    assert err.value.field == "datums"
    assert FORWARD_BACKWARD.parse(payload).loss_fn == "ppo"
