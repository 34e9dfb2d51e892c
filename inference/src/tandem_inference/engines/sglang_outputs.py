"""SGLang's generation replies turned into `Generated`: whole results and stream chunks.

SGLang answers native /generate with `text`, `output_ids` and `meta_info` (token logprobs as
(logprob, id, text) triples, top alternatives, the finish reason, cached prompt tokens). It
streams cumulative or incremental chunks depending on its version and flags; the cumulative
count `meta_info.completion_tokens` tells which, and the text follows the tokens. A cumulative
text may revise its tail: an incomplete UTF-8 character decoded as U+FFFD is later whole, and
SGLang cuts the text where a stop string begins once the stop string is whole. So text that
may still change (stops.py: a trailing U+FFFD, the start of a stop string) is handed out only
once the sample ends: increments never need taking back, and they add up to the unstreamed text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem_inference.engines.base import FinishReason, Generated, TopLogprobs
from tandem_inference.stops import sendable

REPLACEMENT = "\ufffd"


def finish_reason(meta: dict[str, Any]) -> FinishReason | None:
    """`meta_info.finish_reason` ({"type": "length" | "stop" | "abort", ...} or a string) in tandem's words."""
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind is None:
        return None
    return "length" if kind == "length" else "stop"


def alternatives(entry: Any) -> TopLogprobs | None:
    """One position of `output_top_logprobs` ([[logprob, id, text or null], ...] or null)."""
    if not isinstance(entry, list):
        return None
    return [(float(t[0]), int(t[1]), t[2] if len(t) > 2 else None) for t in entry]


class SampleFold:
    """One sample's chunks, as they arrive, turned into increments."""

    def __init__(self, index: int = 0, stops: Sequence[str] = ()) -> None:
        self.index = index
        self.stops = stops
        """The request's stop strings."""
        self.token_ids: list[int] = []
        self.text = ""
        """The sample's whole text as the engine sent it."""
        self._handed = 0
        """How much of `text` was handed out."""

    def add(self, chunk: dict[str, Any]) -> Generated:
        """What `chunk` adds to the sample."""
        meta = chunk.get("meta_info") or {}
        total = meta.get("completion_tokens")
        out = Generated(index=self.index, finish_reason=finish_reason(meta))
        cumulative: bool | None = None  # unknown without token ids: then the text tells
        triples = meta.get("output_token_logprobs")
        if triples:
            ids = [int(t[1]) for t in triples]
            cumulative = self._cumulative(ids, total)
            skip = len(self.token_ids) if cumulative else 0
            tops = list(meta.get("output_top_logprobs") or [])[: len(triples)]
            tops += [None] * (len(triples) - len(tops))
            out.token_ids = ids[skip:]
            out.logprobs = [float(t[0]) for t in triples[skip:]]
            out.token_texts = [t[2] if len(t) > 2 else None for t in triples[skip:]]
            out.top_logprobs = [alternatives(t) for t in tops[skip:]]
        elif chunk.get("output_ids") is not None:
            ids = [int(i) for i in chunk["output_ids"]]
            cumulative = self._cumulative(ids, total)
            out.token_ids = ids[len(self.token_ids):] if cumulative else ids
        self.token_ids += out.token_ids
        text = chunk.get("text")
        if isinstance(text, str):
            if cumulative is None:
                cumulative = text.startswith(self.text.rstrip(REPLACEMENT))
            self.text = text if cumulative else self.text + text
        visible = self.text if out.finish_reason else sendable(self.text, self.stops)
        out.text = visible[self._handed:]
        self._handed = max(self._handed, len(visible))
        if isinstance(meta.get("cached_tokens"), int):
            out.cached_tokens = meta["cached_tokens"]
        return out

    def _cumulative(self, ids: list[int], total: Any) -> bool:
        """Whether `ids` repeat every token so far (cumulative chunk) rather than only new ones."""
        if isinstance(total, int):
            return len(ids) == total
        return len(ids) >= len(self.token_ids) and ids[: len(self.token_ids)] == self.token_ids


def whole(result: dict[str, Any], index: int = 0) -> Generated:
    """A whole (unstreamed) result as one `Generated`: all of its text, ended or not."""
    out = SampleFold(index).add(result)
    text = result.get("text")
    if isinstance(text, str):
        out.text = text
    return out
