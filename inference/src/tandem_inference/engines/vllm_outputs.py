"""vLLM's `/v1/completions` replies turned into `Generated`: whole choices and stream chunks.

Shapes as vLLM 0.33.0 writes them (vllm/entrypoints/openai/completion/protocol.py, serving.py):
a choice carries its `index`, `text`, `finish_reason` ("stop", "length" or "abort"), with
`return_token_ids` the sampled `token_ids`, and with `logprobs` the OpenAI completions object
`{tokens, token_logprobs, top_logprobs, text_offset}`. tandem asks for
`return_tokens_as_token_ids`, so every token there reads `token_id:<id>`: the alternatives of a
position are then told apart by id, not by a decoded text that two tokens may share (the
gateway decodes the text itself where it shows one).

A streamed chunk holds one choice's increment: its new token ids, logprobs and text. vLLM's
detokenizer hands out text only once it can no longer change (vllm/v1/engine/detokenizer.py
holds back what may still turn into a stop string; an incomplete UTF-8 character is not
emitted), so its text deltas add up to the unstreamed text and are passed on as they come. With
`stream_options.include_usage` a last chunk without choices carries the usage.
"""

from __future__ import annotations

from typing import Any

from tandem_inference.engines.base import FinishReason, Generated, TopLogprobs
from tandem_inference.errors import EngineResponseError

#: How vLLM writes a token with `return_tokens_as_token_ids` (vllm/entrypoints/generate/base/serving.py).
TOKEN_ID_PREFIX = "token_id:"


def finish_reason(value: Any) -> FinishReason | None:
    """A choice's `finish_reason` in tandem's words: "length", else "stop" (EOS, stop string, abort)."""
    if value is None:
        return None
    return "length" if value == "length" else "stop"


def token_id(token: Any, url: str) -> int:
    """The id in `token_id:<id>`; EngineResponseError for anything else (the server ignored
    `return_tokens_as_token_ids`)."""
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
        try:
            return int(token[len(TOKEN_ID_PREFIX):])
        except ValueError:
            pass
    raise EngineResponseError(
        f"engine at {url} named a token {str(token)[:80]!r}, expected 'token_id:<id>' "
        "(the request sets return_tokens_as_token_ids; is this vLLM 0.33?)", status_code=200)


def cached_tokens(usage: Any) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` (vLLM sends it with --enable-prompt-tokens-details)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int else None


def choice_output(choice: dict[str, Any], *, top_k: int, url: str) -> Generated:
    """One choice (whole, or one chunk's increment) as `Generated`; `top_k`: alternatives asked for."""
    out = Generated(index=_index(choice), text=str(choice.get("text") or ""),
                    finish_reason=finish_reason(choice.get("finish_reason")))
    ids = choice.get("token_ids")
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        tokens = list(logprobs.get("tokens") or [])
        values = list(logprobs.get("token_logprobs") or [])
        named = [token_id(t, url) for t in tokens]
        if len(values) != len(named) or any(v is None for v in values):
            raise EngineResponseError(
                f"engine at {url} sent {len(values)} logprobs for {len(named)} tokens, some missing; "
                "expected one per token", status_code=200)
        if ids is not None and list(ids) != named:
            raise EngineResponseError(
                f"engine at {url} sent token ids {list(ids)[:8]}... whose logprobs name {named[:8]}...",
                status_code=200)
        out.token_ids = named
        out.logprobs = [float(v) for v in values]
        out.token_texts = [None] * len(named)
        tops = list(logprobs.get("top_logprobs") or [])
        tops += [None] * (len(named) - len(tops))
        out.top_logprobs = [_alternatives(t, top_k, url) for t in tops[: len(named)]]
    elif ids is not None:
        out.token_ids = [int(i) for i in ids]
    return out


def _alternatives(entry: Any, top_k: int, url: str) -> TopLogprobs | None:
    """One position's `{token_id:<id>: logprob}` as the `top_k` best (vLLM adds the sampled token)."""
    if top_k <= 0 or not isinstance(entry, dict):
        return None
    ranked: TopLogprobs = [(float(lp), token_id(t, url), None) for t, lp in entry.items()]
    ranked.sort(key=lambda a: -a[0])
    return ranked[:top_k]


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index", 0)
    return index if type(index) is int else 0
