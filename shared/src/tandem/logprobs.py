"""tandem's one logprob convention, and how far an engine and the trainer are from it.

The policy is the temperature-scaled model: a token sampled at temperature T carries
`log_softmax(logits / T)[token]` (T = 1 for greedy; before top-k/top-p filtering). Every
engine returns that (SGLang by default, with SGLANG_RETURN_ORIGINAL_LOGPROB off; the
transformers engine), each sample carries its `temperature`, and the trainer divides its logits
by it before its own log-softmax, for the ratio, the KL term and the entropy alike.

Why: the tokens were drawn from the scaled distribution, so its ratio pi_T(new)/pi_T(old) is
the importance weight of what was sampled, the one PPO's clip is meant to bound, and its
gradient is the policy gradient of the distribution that produced the rewards. The unscaled
model's ratio differs from it even for unchanged weights (by the change of the logits times
1 - 1/T, less the change of the normaliser), so at T = 0.7 the clip would fire on tokens
that did not change, and its gradient pushes a distribution nobody sampled from. Top-p and
top-k truncation are left out of both sides (as SGLang's logprobs leave them out): the ratio
of two truncated distributions would change with the truncation set itself.

`Mismatch` measures the per-token distance between an engine's logprobs and the trainer's for
the same tokens and weights: the number RL users watch for train-inference mismatch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-6
"""Below this a request is greedy (argmax), and its logprobs are those of temperature 1."""

OUTLIER = 0.1
"""|Δ logprob| above which a token counts as an outlier."""


def policy_temperature(temperature: float | None) -> float:
    """The temperature whose distribution a sample's logprobs are under: the sampling temperature,
    or 1 for greedy decoding (temperature 0) and for a request that gave none."""
    if temperature is None or temperature < MIN_TEMPERATURE:
        return 1.0
    return float(temperature)


@dataclass(frozen=True)
class Mismatch:
    """Per-token |engine - trainer| logprob differences over every compared token."""

    tokens: int
    mean_abs: float
    max_abs: float
    over_outlier: float
    """Share of tokens whose |Δ| is above OUTLIER."""
    ratio_mean: float
    """Mean of exp(trainer - engine): the first epoch's importance ratio (1 when they agree)."""

    @classmethod
    def of(cls, engine: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> Mismatch:
        deltas = [t - e for es, ts in zip(engine, trainer, strict=True) for e, t in zip(es, ts, strict=True)]
        if not deltas:
            raise ValueError("no token to compare: every sample is empty")
        absolute = [abs(d) for d in deltas]
        return cls(
            tokens=len(deltas),
            mean_abs=sum(absolute) / len(absolute),
            max_abs=max(absolute),
            over_outlier=sum(a > OUTLIER for a in absolute) / len(absolute),
            ratio_mean=sum(math.exp(d) for d in deltas) / len(deltas),
        )
