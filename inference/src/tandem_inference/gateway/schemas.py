"""The gateway's request bodies: OpenAI's chat and completions, with their limits.

Unknown OpenAI fields (user, stream_options, ...) are ignored, not refused; NaN, Infinity and
lone surrogates are refused anywhere (see bodies.py). Every number is bounded, so a bad value
is a 422 naming its field before anything reaches the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from tandem.episodes import EPISODE_ID as episode_ids
from tandem_inference.bodies import MAX_TOP_LOGPROBS, Body, ChatLogprobs

#: Most samples one request may ask for (`n`).
MAX_N = 64
#: `max_tokens` when a request names none (never above settings.engine.max_new_tokens_limit).
DEFAULT_MAX_TOKENS = 128
MAX_MODEL_CHARS = 256
"""Longest `model` accepted: a run name (63), `@v` and a version fit many times over."""
EPISODE_ID = episode_ids.pattern
"""What an episode id may be (the client checks the same pattern): it becomes part of a Redis key and a URL path."""
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
"""What a function name may be (OpenAI's rule)."""

Kind = Literal["chat", "text"]
"""Which API a request came in by: chat completions or (text) completions."""


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionSpec(Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema."""


class Tool(Body):
    """A tool the model may call: OpenAI's `{"type": "function", "function": {...}}`."""

    type: Literal["function"]
    function: FunctionSpec

    def as_template_input(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(Body):
    name: str = Field(pattern=TOOL_NAME)


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Body):
    name: str = Field(min_length=1)
    arguments: str
    """The arguments as a JSON text, as OpenAI sends them."""


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    """Text; may be null or empty on an assistant message that carries `tool_calls`."""
    tool_calls: list[ToolCall] | None = None
    """The calls an assistant message made."""
    tool_call_id: str | None = None
    """Which call a tool message answers."""

    @model_validator(mode="after")
    def _content_and_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs `content` (only an assistant message with "
                             "`tool_calls` may leave it null)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message carries `tool_calls`; only assistant messages may")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, calls with their arguments as objects."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def canonical(self) -> str:
        """The message as one JSON text, to compare with what an episode holds: what it says, not
        how it was sent (null, empty and missing content are the same; text parts are joined)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return json.dumps(out, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them (an object); the text itself if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


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
    def alternatives_per_token(self) -> int:
        """How many alternatives per token the reply lists (0: none)."""
        return 0


class ChatRequest(ChatLogprobs, SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives per token in `logprobs.content[].top_logprobs`; needs `logprobs: true`."""
    tools: list[Tool] | None = None
    """Functions the model may call; handed to the chat template."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """`none` leaves the tools out of the prompt; any other choice renders them the same."""
    episode: str | None = Field(None, pattern=EPISODE_ID)
    """The multi-turn episode this request continues (or starts): see gateway/episodes.py."""
    response_format: dict[str, Any] | None = None
    """Only `{"type": "text"}` (the default): structured outputs are refused, never ignored."""

    @field_validator("response_format")
    @classmethod
    def _no_structured_output(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = value.get("type") if isinstance(value, dict) else None
        if value is not None and kind != "text":
            raise ValueError(
                f"response_format type {kind!r} is not supported: tandem's engines do not constrain decoding "
                "to a JSON schema yet, and the field would change what the reply means; leave response_format "
                "out (or {\"type\": \"text\"}) and ask for JSON in the prompt, then parse the reply")
        return value

    @model_validator(mode="after")
    def _named_tool_exists(self) -> ChatRequest:
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in self.tool_names():
                raise ValueError(f"tool_choice names the function {name!r}, which is not among `tools` "
                                 f"{self.tool_names()}; add it to tools or choose 'auto'")
        return self

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders: none with `tool_choice: "none"`."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.as_template_input() for t in self.tools]


class CompletionRequest(SamplingRequest):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """OpenAI's completions API takes a count here: any value asks for logprobs, and that many
    alternatives per token come back in `top_logprobs`."""

    @property
    def alternatives_per_token(self) -> int:
        return self.logprobs or 0
