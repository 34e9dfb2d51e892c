"""What the engine produced for a request: its choices (`Output`) and their `usage`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem_inference.engines.base import Generated, TopLogprobs


@dataclass
class Output:
    """One choice, folded from the engine's whole sample or from its streamed increments."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str | None] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    """Per token, the alternatives the engine listed (None where it listed none)."""
    finish_reason: str | None = None
    cached_tokens: int = 0
    """Prompt tokens the engine's prefix cache served."""

    def update(self, new: Generated) -> tuple[str, int]:
        """Fold in what the engine added; returns (its text, index of its first token)."""
        start = len(self.token_ids)
        self.token_ids += new.token_ids
        self.logprobs += new.logprobs
        self.token_texts += new.token_texts
        self.top_logprobs += new.top_logprobs
        self.text += new.text
        self.finish_reason = new.finish_reason or self.finish_reason
        if new.cached_tokens is not None:
            self.cached_tokens = new.cached_tokens
        return new.text, start


def usage(input_ids: list[int], outputs: list[Output]) -> dict[str, Any]:
    """OpenAI's `usage` of a request's choices."""
    completion = sum(len(o.token_ids) for o in outputs)
    # each of the n choices is its own engine request over the same prompt: report the most
    # any of them found in the prefix cache
    cached = max((o.cached_tokens for o in outputs), default=0)
    return {"prompt_tokens": len(input_ids), "completion_tokens": completion,
            "total_tokens": len(input_ids) + completion, "prompt_tokens_details": {"cached_tokens": cached}}
