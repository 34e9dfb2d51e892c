"""The gateway's request bodies: OpenAI's chat and completions, with their limits.

Unknown OpenAI fields (user, stream_options, ...) are ignored, not refused; NaN, Infinity and
lone surrogates are refused anywhere (see bodies.py). Every number is bounded, so a bad value
is a 422 naming its field before anything reaches the engine.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tandem_inference.bodies import MAX_TOP_LOGPROBS, Body, ChatLogprobs

#: Most samples one request may ask for (`n`).
MAX_N = 64
#: `max_tokens` when a request names none (never above settings.engine.max_new_tokens_limit).
DEFAULT_MAX_TOKENS = 128
MAX_MODEL_CHARS = 256
"""Longest `model` accepted: a run name (63), `@v` and a version fit many times over."""

Kind = Literal["chat", "text"]
"""Which API a request came in by: chat completions or (text) completions."""


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class SamplingRequest(Body):
    """What chat and completion requests share: the model, sampling, `n`, stops, streaming."""

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False

    @property
    def top_logprobs_num(self) -> int:
        """How many alternatives per token the reply lists (0: none)."""
        return 0


class ChatRequest(ChatLogprobs, SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives per token in `logprobs.content[].top_logprobs`; needs `logprobs: true`."""


class CompletionRequest(SamplingRequest):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """OpenAI's completions API takes a count here: any value asks for logprobs, and that many
    alternatives per token come back in `top_logprobs`."""

    @property
    def top_logprobs_num(self) -> int:
        return self.logprobs or 0
