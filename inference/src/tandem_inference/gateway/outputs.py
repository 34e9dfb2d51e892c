"""What the engine produced for a request: its choices (`Output`) and their `usage`.

The engine answers SGLang's native shape: `text`, `output_ids` and `meta_info` (token logprobs
as (logprob, id, text) triples, top alternatives, the finish reason, cached prompt tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem_inference.stops import sendable


def _finish_reason(meta: dict[str, Any]) -> str | None:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind is None:
        return None
    return "length" if kind == "length" else "stop"


TopLogprobs = list[tuple[float, int, str | None]]
"""The alternatives at one position, as SGLang's `output_top_logprobs` lists them: (logprob, id, text)."""


@dataclass
class Output:
    """One choice as the engine produced it, built from a whole result or from stream chunks.

    SGLang streams cumulative or incremental chunks depending on its version and flags; the
    cumulative count `meta_info.completion_tokens` tells which, and the text follows the tokens,
    so both are handled. The engine cuts the text where a stop string begins once the stop
    string is whole, so while it may still be arriving, text that could begin one of `stops`
    is held back (stops.py): streamed deltas add up to the unstreamed text.
    """

    stops: Sequence[str] = ()
    """The request's stop strings."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str | None] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    """Per token, the alternatives the engine listed (None where it listed none)."""
    finish_reason: str | None = None
    cached_tokens: int = 0
    """Prompt tokens the engine's prefix cache served (SGLang's meta_info.cached_tokens)."""
    _sent: int = field(default=0, repr=False)
    """How much of `text` was handed out as deltas."""

    def update(self, chunk: dict[str, Any]) -> tuple[str, int]:
        """Fold in one chunk; returns (new text, index of the first new token)."""
        meta = chunk.get("meta_info") or {}
        total = meta.get("completion_tokens")
        start = len(self.token_ids)
        cumulative: bool | None = None  # unknown without token ids: then the text tells
        triples = meta.get("output_token_logprobs")
        if triples:
            ids = [int(t[1]) for t in triples]
            cumulative = self._cumulative(ids, total)
            keep = 0 if cumulative else len(self.token_ids)
            tops = list(meta.get("output_top_logprobs") or [])[: len(triples)]
            tops += [None] * (len(triples) - len(tops))
            self.token_ids = self.token_ids[:keep] + ids
            self.logprobs = self.logprobs[:keep] + [float(t[0]) for t in triples]
            self.token_texts = self.token_texts[:keep] + [t[2] if len(t) > 2 else None for t in triples]
            self.top_logprobs = self.top_logprobs[:keep] + [_alternatives(t) for t in tops]
        elif chunk.get("output_ids") is not None:
            ids = [int(i) for i in chunk["output_ids"]]
            cumulative = self._cumulative(ids, total)
            keep = 0 if cumulative else len(self.token_ids)
            self.token_ids = self.token_ids[:keep] + ids
        text = chunk.get("text")
        if isinstance(text, str):
            if cumulative is None:
                cumulative = text.startswith(self.text.rstrip("\ufffd"))
            self.text = text if cumulative else self.text + text
        self.finish_reason = _finish_reason(meta) or self.finish_reason
        if isinstance(meta.get("cached_tokens"), int):
            self.cached_tokens = meta["cached_tokens"]
        visible = self.text if self.finish_reason else sendable(self.text, self.stops)
        delta = visible[self._sent:]
        self._sent = max(self._sent, len(visible))
        return delta, min(start, len(self.token_ids))

    def _cumulative(self, ids: list[int], total: Any) -> bool:
        """Whether `ids` repeat every token so far (cumulative chunk) rather than only new ones."""
        if isinstance(total, int):
            return len(ids) == total
        return len(ids) >= len(self.token_ids) and ids[: len(self.token_ids)] == self.token_ids


def _alternatives(entry: Any) -> TopLogprobs | None:
    """One position of SGLang's `output_top_logprobs` ([[logprob, id, text or null], ...] or null)."""
    if not isinstance(entry, list):
        return None
    return [(float(t[0]), int(t[1]), t[2] if len(t) > 2 else None) for t in entry]


def usage(input_ids: list[int], outputs: list[Output]) -> dict[str, Any]:
    """OpenAI's `usage` of a request's choices."""
    completion = sum(len(o.token_ids) for o in outputs)
    # each of the n choices is its own engine request over the same prompt: report the most
    # any of them found in the prefix cache
    cached = max((o.cached_tokens for o in outputs), default=0)
    return {"prompt_tokens": len(input_ids), "completion_tokens": completion,
            "total_tokens": len(input_ids) + completion, "prompt_tokens_details": {"cached_tokens": cached}}
