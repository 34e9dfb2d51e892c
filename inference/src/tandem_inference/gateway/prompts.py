"""Prompts as token ids: the gateway tokenizes, so the reply can carry the exact ids.

Chat messages go through the base model's chat template, a completion's text through its
tokenizer; token ids a client sends are checked against the vocabulary. A prompt that cannot be
made is a 422 naming why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import HTTPException

from tandem_inference.gateway.schemas import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_ids(tokenizer: PreTrainedTokenizerBase, body: ChatRequest) -> list[int]:
    """The token ids of the chat template applied to `body`'s messages, ready for the reply."""
    messages = [m.as_template_input() for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja errors of the template name the problem
        raise HTTPException(422, f"the chat template cannot render these messages: {exc}") from exc
    if not isinstance(text, str):
        raise HTTPException(422, f"the chat template rendered {type(text).__name__}, not text")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def completion_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int, body: CompletionRequest) -> list[int]:
    """The prompt's token ids: its text tokenized, or its ids if all are below `vocab_size`."""
    if isinstance(body.prompt, str):
        return list(tokenizer(body.prompt)["input_ids"])
    bad = [t for t in body.prompt if not 0 <= t < vocab_size]
    if bad:
        raise HTTPException(422, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return list(body.prompt)
