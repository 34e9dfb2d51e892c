"""Prompts as token ids: the gateway tokenizes, so the reply can carry the exact ids.

Chat messages (and the request's tools) go through the base model's chat template, a
completion's text through its tokenizer; token ids a client sends are checked against the
vocabulary. A prompt that cannot be made is a 422 naming why.

An episode's later turns are rendered as a delta (`delta_ids`): only the tokens the new messages
add after an assistant turn, so the ids the model sampled stay as they were instead of being
re-rendered from their text (which can tokenize differently).

Message content is text, never control: a content holding the text of a special token
(`<|im_end|>`, `<|im_start|>`, ...) is tokenized with special tokens split into ordinary pieces,
so a tool result or a user cannot forge turns; special tokens come only from where the template
puts them. Such contents are rendered as placeholders and tokenized on their own; a request with
none tokenizes exactly as before. (A raw /v1/completions prompt is the client's own template
and keeps its special tokens.)

A prompt far past the engine's context is refused before it is tokenized (`check_size`): no
token spans more than `max_token_bytes` bytes, so a text of more bytes than that many times the
context cannot fit. The gateway builds prompts in a worker thread, never on its event loop.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException

from tandem_inference.errors import RequestRefused
from tandem_inference.gateway.schemas import ChatMessage, ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_STAND_IN = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
"""A conversation ending in an assistant turn whose content is `A`: the delta of new messages is
what rendering them after it adds. Its content never reaches a prompt."""


_MAX_TOKEN_BYTES: dict[int, int] = {}
_SPECIAL_TEXTS: dict[int, tuple[str, ...]] = {}
"""Per tokenizer (by id: the gateway keeps one for its life), what is read from its vocabulary once."""


def max_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most bytes of text one token of the vocabulary stands for (computed once per tokenizer).

    A token's string has at most 4 bytes per character, and a byte-level BPE string exactly one
    character per byte, so only the tokens whose 4 x length could beat the best so far are decoded.
    """
    key = id(tokenizer)
    if key not in _MAX_TOKEN_BYTES:
        best = 1
        for token in sorted(tokenizer.get_vocab(), key=len, reverse=True):
            if 4 * len(token) <= best:
                break
            best = max(best, len(tokenizer.convert_tokens_to_string([token]).encode("utf-8", "replace")))
        _MAX_TOKEN_BYTES[key] = best
    return _MAX_TOKEN_BYTES[key]


def special_texts(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The text of every special token (`<|im_end|>`, ...), read once per tokenizer."""
    key = id(tokenizer)
    if key not in _SPECIAL_TEXTS:
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        found = [*tokenizer.all_special_tokens, *(str(t) for t in added if getattr(t, "special", False))]
        _SPECIAL_TEXTS[key] = tuple(dict.fromkeys(t for t in found if t))
    return _SPECIAL_TEXTS[key]


def check_size(tokenizer: PreTrainedTokenizerBase, text: str, limit: int | None) -> None:
    """A 400 when `text` certainly holds more than `limit` tokens, before tokenizing it."""
    if limit is None:
        return
    floor = len(text.encode("utf-8", "replace")) // max_token_bytes(tokenizer)
    if floor > limit:
        raise HTTPException(400, f"the prompt is at least {floor} tokens, above the engine's context length {limit} "
                                 "tokens; send fewer or shorter messages (or tools)")


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
           tools: list[dict[str, Any]] | None, *, generation_prompt: bool) -> str:
    """The chat template applied to `messages` (and `tools`), as text; a 422 if it cannot be."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja errors of the template name the problem
        raise HTTPException(422, f"the chat template cannot render these messages: {exc}") from exc
    if not isinstance(text, str):
        raise HTTPException(422, f"the chat template rendered {type(text).__name__}, not text")
    return text


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Rendered text as ids: the template wrote every special token, so none is added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class Guard:
    """Stands in for the message contents that hold a special token's text while the template renders,
    and tokenizes them as plain text afterwards."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.specials = special_texts(tokenizer)
        self.nonce = secrets.token_hex(8)
        self.held: dict[str, str] = {}

    def messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` with each string content that holds a special token's text swapped for a placeholder."""
        out = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) and any(s in content for s in self.specials):
                key = f"<<tandem-{self.nonce}-{len(self.held)}>>"
                self.held[key] = content
                message = {**message, "content": key}
            out.append(message)
        return out

    def encode(self, text: str) -> list[int]:
        """Rendered text as ids: the template's own special tokens as such, the held contents as text."""
        if not self.held:
            return encode(self.tokenizer, text)
        ids: list[int] = []
        for i, piece in enumerate(re.split(f"(<<tandem-{self.nonce}-\\d+>>)", text)):
            if i % 2 and piece in self.held:
                ids += self.tokenizer(self.held[piece], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            elif piece:
                ids += encode(self.tokenizer, piece)
        return ids


def chat_ids(tokenizer: PreTrainedTokenizerBase, body: ChatRequest, limit: int | None = None) -> list[int]:
    """The token ids of the chat template applied to `body`'s messages and tools, ready for the
    reply; a 400 without tokenizing when they cannot fit `limit` tokens."""
    guard = Guard(tokenizer)
    messages = guard.messages([m.as_template_input() for m in body.messages])
    text = render(tokenizer, messages, body.template_tools(), generation_prompt=True)
    check_size(tokenizer, text, limit)
    return guard.encode(text)


def delta_ids(tokenizer: PreTrainedTokenizerBase, new: Sequence[ChatMessage],
              tools: list[dict[str, Any]] | None, sampled: Sequence[int]) -> list[int]:
    """What follows an assistant turn that sampled `sampled` when `new` messages come after it.

    The tokens that close the assistant turn (those the model did not sample itself: all of
    them when max_tokens cut the turn, fewer when it ended on the template's end-of-turn
    token), then each new message as the template renders it there, then the generation prompt.
    """
    guard = Guard(tokenizer)
    before = render(tokenizer, _STAND_IN, tools, generation_prompt=False)
    after = render(tokenizer, [*_STAND_IN, *guard.messages([m.as_template_input() for m in new])], tools,
                   generation_prompt=True)
    cut = before.rfind(_STAND_IN[-1]["content"]) + len(_STAND_IN[-1]["content"])
    if not after.startswith(before) or cut < len(_STAND_IN[-1]["content"]):
        raise HTTPException(422, "the chat template renders earlier messages differently once new ones follow, "
                                 "so an episode cannot continue with it; send each turn as a plain request")
    closing = encode(tokenizer, before[cut:])
    return closing[_overlap(sampled, closing):] + guard.encode(after[len(before):])


def _overlap(sampled: Sequence[int], closing: list[int]) -> int:
    """How many of the closing tokens the sampled ids already end with (the end-of-turn token)."""
    for k in range(min(len(sampled), len(closing)), 0, -1):
        if list(sampled[-k:]) == closing[:k]:
            return k
    return 0


def completion_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int, body: CompletionRequest,
                   limit: int | None = None) -> list[int]:
    """The prompt's token ids: its text tokenized, or its ids if all are below `vocab_size`."""
    if isinstance(body.prompt, str):
        check_size(tokenizer, body.prompt, limit)
        return list(tokenizer(body.prompt)["input_ids"])
    bad = [t for t in body.prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestRefused(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}); send ids "
                             "the model's tokenizer gives, or the prompt as text", param="prompt")
    return list(body.prompt)
