"""The toy task that proves the loop: teach a model to answer with digits.

reward = share of completion tokens that are digit tokens. It needs no judge and no data,
it is cheap to score, and a policy visibly learns it in a few dozen GRPO steps, so the demo,
the end-to-end tests and the GPU check all use it. Digit tokens are read from the model's
`tokenizer.json` (Qwen2-style tokenizers split digits one per token).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.client import Run
from tandem.trajectories import Completion, TrajectoryGroup

PROMPTS = (
    "Write some numbers.",
    "What comes next: 3 5 7",
    "Tell me about your day.",
    "Give me a phone number.",
    "Count for me.",
    "What is the answer?",
    "Say something.",
    "List a few values.",
)


def digit_token_ids(model_dir: str | Path) -> frozenset[int]:
    """Ids of the vocabulary entries made of ASCII digits only (byte-level "²" is not a digit here)."""
    data = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    ids = {i for token, i in vocab.items() if token.isascii() and token.isdigit()}
    return frozenset(ids)


def digit_share(completion: Completion, digits: frozenset[int]) -> float:
    """The reward: share of the completion's tokens that are digits."""
    ids = completion.completion_ids
    return sum(t in digits for t in ids) / len(ids) if ids else 0.0


@dataclass
class Rollouts:
    """One step's scored groups, and what served them."""

    groups: list[TrajectoryGroup] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def mean_reward(self) -> float:
        return statistics.fmean(self.rewards)


def roll_out(
    run: Run,
    digits: frozenset[int],
    prompts: Sequence[str],
    *,
    group_size: int = 8,
    max_tokens: int = 16,
) -> Rollouts:
    """Sample a group per prompt through the gateway and score it."""
    out = Rollouts()
    for prompt in prompts:
        comps = run.chat([{"role": "user", "content": prompt}], n=group_size, max_tokens=max_tokens)
        scores = [digit_share(c, digits) for c in comps]
        out.groups.append(run.group(comps, scores))
        out.rewards += scores
        out.versions += [c.version for c in comps]
    return out


def prompts_for(step: int, per_step: int) -> list[str]:
    """The prompts of a step, cycling through PROMPTS."""
    return [PROMPTS[(step * per_step + p) % len(PROMPTS)] for p in range(per_step)]
