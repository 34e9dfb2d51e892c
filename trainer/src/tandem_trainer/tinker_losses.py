"""Tinker's built-in losses, by their names, and the checks of a datum's inputs before any work.

Tinker (tinker-docs.thinkingmachines.ai, "Loss Functions"; the SDK's `LossFnType`) defines each
loss on one datum's per-token tensors, all of length N (the datum's `tokens`): position i of the
input predicts `target_tokens[i]`, and `target_logprobs[i]` is its log-probability under the
weights now. Every loss is a sum over tokens, and the job's loss the sum over its datums (no
mean anywhere: the caller scales with `weights` or `advantages`):

- `cross_entropy` (inputs `target_tokens`, `weights`):
  `loss = -(target_logprobs * weights).sum()`
- `importance_sampling` (inputs `target_tokens`, `logprobs` (the sampler's), `advantages`):
  `ratio = exp(target_logprobs - logprobs)`, `loss = -(ratio * advantages).sum()`
- `ppo` (same inputs): `clipped = clamp(ratio, clip_low_threshold, clip_high_threshold)`,
  `loss = -min(ratio * advantages, clipped * advantages).sum()`
- `cispo` (same inputs): `loss = -(clamp(ratio, low, high).detach() * target_logprobs * advantages).sum()`

`clip_low_threshold` and `clip_high_threshold` come from the call's `loss_fn_config`; they are
bounds on the ratio itself, 0.8 and 1.2 by default (Tinker's epsilon of 0.2 on either side).
The RL losses take no `weights` (Tinker's formulas have none: a prompt token is left out with an
advantage of 0); one that is sent is checked for its length and otherwise not used. Tinker's
top-K form of `cross_entropy` (inputs of shape (N, K)) is not supported: the payload carries
one value per token.

Every check names the datum and the field (`datums.2.inputs.advantages`) and says what to send.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from tandem.tinker_jobs import Datum, LossName
from tandem_trainer.errors import JobRejected

#: The `loss_fn_inputs` each loss needs.
REQUIRED: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
#: Every input name a datum may carry (each a list as long as its tokens).
KNOWN_INPUTS = ("target_tokens", "weights", "logprobs", "advantages")
#: The `loss_fn_config` each loss takes, with its defaults.
CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


def loss_config(loss_fn: LossName, given: Mapping[str, float]) -> dict[str, float]:
    """The loss's config: `given` over the defaults; a key the loss does not take, a value that is
    not finite or thresholds that are not 0 <= low <= high are refused naming `loss_fn_config.<key>`."""
    defaults = CONFIG_DEFAULTS[loss_fn]
    for key, value in given.items():
        field = f"loss_fn_config.{key}"
        if key not in defaults:
            takes = ", ".join(defaults) or "no keys"
            raise JobRejected(f"{field}: loss {loss_fn!r} takes {takes}; leave {key!r} out", field=field)
        if not math.isfinite(value):
            raise JobRejected(f"{field}: {value} is not a finite number", field=field)
    config = {**defaults, **given}
    if defaults:
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        if not 0.0 <= low <= high:
            field = "loss_fn_config.clip_low_threshold"
            raise JobRejected(f"{field}: the ratio's bounds must be 0 <= clip_low_threshold <= clip_high_threshold; "
                              f"got {low} and {high} (Tinker's default: 0.8 and 1.2)", field=field)
    return config


def check_datums(datums: Sequence[Datum], loss_fn: LossName, *, vocab_size: int, max_positions: int) -> None:
    """Every datum fits the model and carries what `loss_fn` needs, each input as long as its tokens;
    else JobRejected naming the first datum and field at fault."""
    required = REQUIRED[loss_fn]
    for i, datum in enumerate(datums):
        where = f"datums.{i}"
        n = len(datum.tokens)
        if n > max_positions:
            raise JobRejected(f"{where}.tokens: {n} tokens, more than the model's {max_positions} positions; "
                              "send a shorter sequence", field=f"{where}.tokens")
        bad = next((t for t in datum.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise JobRejected(f"{where}.tokens: token id {bad} is outside the model's vocabulary "
                              f"[0, {vocab_size})", field=f"{where}.tokens")
        for name in required:
            if name not in datum.inputs:
                field = f"{where}.inputs.{name}"
                raise JobRejected(f"{field}: loss {loss_fn!r} needs loss_fn_inputs {list(required)}; datum {i} "
                                  f"has no {name!r}", field=field)
        for name, values in datum.inputs.items():
            _check_input(where, name, values, n, vocab_size)


def _check_input(where: str, name: str, values: Sequence[float], n: int, vocab_size: int) -> None:
    field = f"{where}.inputs.{name}"
    if name not in KNOWN_INPUTS:
        raise JobRejected(f"{field}: unknown loss_fn_input {name!r}; the losses read {list(KNOWN_INPUTS)}",
                          field=field)
    if len(values) != n:
        raise JobRejected(f"{field}: {len(values)} values for {n} tokens; each loss_fn_input is one value "
                          "per token of model_input", field=field)
    bad = next((v for v in values if not math.isfinite(v)), None)
    if bad is not None:
        raise JobRejected(f"{field}: {bad} is not a finite number", field=field)
    if name == "target_tokens":
        wrong = next((v for v in values if v != int(v) or not 0 <= v < vocab_size), None)
        if wrong is not None:
            raise JobRejected(f"{field}: {wrong} is not a token id of the model's vocabulary [0, {vocab_size})",
                              field=field)


def datum_loss(loss_fn: LossName, target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
               config: Mapping[str, float]) -> torch.Tensor:
    """One datum's loss (a scalar) from its per-token `target_logprobs` [N] and its inputs [N] (see
    the module's docstring); the gradient flows through `target_logprobs` only."""
    if loss_fn == "cross_entropy":
        return -(target_logprobs * inputs["weights"]).sum()
    advantages = inputs["advantages"]
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    if loss_fn == "importance_sampling":
        return -(ratio * advantages).sum()
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    if loss_fn == "ppo":
        return -torch.min(ratio * advantages, clipped * advantages).sum()
    if loss_fn == "cispo":
        return -(clipped.detach() * target_logprobs * advantages).sum()
    raise JobRejected(f"loss_fn: unknown loss {loss_fn!r}; Tinker's losses here are {list(REQUIRED)}",
                      field="loss_fn")
