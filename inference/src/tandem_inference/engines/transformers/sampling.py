"""What a request asks of the sampler, what it gets back, and the draw of one token per row.

Logprobs follow tandem's one convention (`tandem.logprobs`, docs/architecture.md): every
generated token carries `log_softmax(logits / T)[token]`, its log-probability under the
*temperature-scaled* distribution the token was drawn from (T = 1 for greedy), before
top-k/top-p/min-p filtering. That is what SGLang returns, and what the trainer
recomputes in its teacher-forced pass with the sample's temperature, so rollout and trainer
logprobs agree (to float error) on the same weights. Top logprobs (`top_logprobs`, SGLang's
`top_logprobs_num`) list the most likely tokens of that same distribution at each step.

torch is imported inside `sample`, so importing this module is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tandem.logprobs import policy_temperature
from tandem_inference.bodies import MAX_TOP_LOGPROBS
from tandem_inference.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

MAX_BATCH_ROWS = 64  # most rows one batch may hold: n of one request, or coalesced requests
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes

FinishReason = Literal["stop", "length", "abort"]
TopLogprobs = tuple[list[list[float]], list[list[int]]]
"""Per batch row, the best logprobs and their token ids, best first."""


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler (SGLang's `sampling_params`, validated)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    seed: int | None = None  # None = non-deterministic
    top_logprobs: int = 0  # alternatives listed per token (SGLang's top_logprobs_num), best first

    def check(self) -> SamplingParams:
        """Return self, or raise InvalidRequest naming the first bad value."""
        rules = [
            (self.max_new_tokens >= 0, f"max_new_tokens={self.max_new_tokens} must be >= 0"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0"),
            (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k={self.top_k} must be -1 (off) or >= 1"),
            (0 <= self.min_p <= 1, f"min_p={self.min_p} must be in [0, 1]"),
            (self.n >= 1, f"n={self.n} must be >= 1"),
            (self.n <= MAX_BATCH_ROWS, f"n={self.n} must be <= {MAX_BATCH_ROWS}; fan larger groups out"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (
                self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
                f"seed={self.seed} must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]",
            ),
            (
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                f"top_logprobs={self.top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
        ]
        for ok, message in rules:
            if not ok:
                raise InvalidRequest(f"sampling_params: {message}")
        return self


@dataclass
class Sequence:
    """One sample: its tokens, their logprobs, its text and why it ended (None while running)."""

    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """Per token, the `params.top_logprobs` most likely tokens as (logprob, id), best first."""
    text: str = ""
    finish_reason: FinishReason | None = None
    matched: int | str | None = None  # the eos/stop token id or the stop string


def sample(
    logits: torch.Tensor, p: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, TopLogprobs | None]:
    """Draw one token per row; return the tokens, their logprobs under the temperature-scaled
    distribution, and per row the `p.top_logprobs` best (logprobs, ids) of it (or None)."""
    import torch

    logits = logits.float()
    policy = torch.log_softmax(logits / policy_temperature(p.temperature), dim=-1)
    tops = None
    if p.top_logprobs:
        best = policy.topk(min(p.top_logprobs, policy.shape[-1]), dim=-1)
        tops = (best.values.tolist(), best.indices.tolist())
    if p.temperature < 1e-6:
        tokens = logits.argmax(dim=-1)
    else:
        scores = logits / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(dim=-1)
            ordered = ordered.masked_fill(probs.cumsum(dim=-1) - probs > p.top_p, float("-inf"))
            scores = torch.empty_like(scores).scatter_(-1, order, ordered)
        if p.min_p > 0:
            probs = scores.softmax(dim=-1)
            scores = scores.masked_fill(
                probs < p.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf")
            )
        tokens = torch.multinomial(scores.softmax(dim=-1), 1, generator=gen).squeeze(-1)
    return tokens, policy.gather(-1, tokens[:, None]).squeeze(-1), tops
