"""OpenAI's shapes of the engine's samples: chat and completion replies, stream chunks, logprobs.

Streams send text deltas that add up to exactly the unstreamed text: while a stop string may
still be forming, its beginning is held back (see stops.py). Chat messages with OpenAI's
list-of-parts content are joined into text before the chat template sees them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tandem_inference.bodies import by_text
from tandem_inference.engines.transformers.bridge import Step
from tandem_inference.engines.transformers.model import Model
from tandem_inference.engines.transformers.sampling import Sequence
from tandem_inference.errors import InvalidRequest
from tandem_inference.stops import sendable


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with string contents (OpenAI's list-of-parts content is joined), checked."""
    if not messages:
        raise InvalidRequest("empty input: messages is empty")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise InvalidRequest(f"messages[{i}].role must be a string, got {role!r}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "role": role, "content": content or ""})
    return out


def logprobs(model: Model, s: Sequence, start: int, chat: bool, top: bool) -> dict[str, Any]:
    """OpenAI logprobs of the tokens of `s` from `start` on; with `top`, their alternatives too."""
    tokens = [model.decode([t]) for t in s.output_ids[start:]]
    lps = s.logprobs[start:]
    alternatives = [[(model.decode([t]), lp) for lp, t in alts] for alts in s.top_logprobs[start:]]
    alternatives += [[] for _ in range(len(tokens) - len(alternatives))]
    if chat:
        return {
            "content": [
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": list(tok.encode()),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alts],
                }
                for tok, lp, alts in zip(tokens, lps, alternatives, strict=False)
            ]
        }
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    tops = [by_text(alts) for alts in alternatives] if top else None
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def reply(
    model: Model,
    base: dict[str, Any],
    seqs: list[Sequence],
    *,
    chat: bool,
    want_logprobs: bool,
    top: int,
    prompts: list[list[int]],
    token_ids: bool,
) -> dict[str, Any]:
    """A whole chat or completion reply: one choice per sequence, and the usage."""
    choices = []
    for i, s in enumerate(seqs):
        lp = logprobs(model, s, 0, chat, top > 0) if want_logprobs else None
        choice: dict[str, Any] = {
            "index": i,
            "logprobs": lp,
            "finish_reason": s.finish_reason,
            "matched_stop": s.matched,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": s.text}
        else:
            choice["text"] = s.text
        if token_ids:
            choice["token_ids"] = s.output_ids
        choices.append(choice)
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(s.output_ids) for s in seqs)
    response = {
        **base,
        "object": "chat.completion" if chat else "text_completion",
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }
    if token_ids:
        response["prompt_token_ids"] = prompts if len(prompts) > 1 else prompts[0]
    return response


async def chunks(
    model: Model,
    base: dict[str, Any],
    events: AsyncIterator[Step],
    n_choices: int,
    chat: bool,
    want_logprobs: bool,
    top: int,
    stops: tuple[str, ...],
    usage_prompt: int | None,
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI stream chunks: a role delta first (chat), then text deltas, then finish reasons."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    sent = [""] * n_choices
    tokens = [0] * n_choices
    completion = 0
    if chat:
        yield {
            **base,
            "object": kind,
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(n_choices)
            ],
        }
    async for i, s in events:
        lp = logprobs(model, s, tokens[i], chat, top > 0) if want_logprobs else None
        tokens[i] = len(s.output_ids)
        text = s.text if s.finish_reason else sendable(s.text, stops)
        delta = text[len(sent[i]) :] if text.startswith(sent[i]) else ""
        sent[i] += delta
        choice: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": s.finish_reason}
        if s.finish_reason:
            choice["matched_stop"] = s.matched
            completion += len(s.output_ids)
        if chat:
            choice["delta"] = {"content": delta} if delta or not s.finish_reason else {}
        else:
            choice["text"] = delta
        yield {**base, "object": kind, "choices": [choice]}
    if usage_prompt is not None:
        yield {
            **base,
            "object": kind,
            "choices": [],
            "usage": {
                "prompt_tokens": usage_prompt,
                "completion_tokens": completion,
                "total_tokens": usage_prompt + completion,
            },
        }
