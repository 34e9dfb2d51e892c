"""The gateway's request bodies: OpenAI's chat and completions, with their limits.

Unknown OpenAI fields that do not change the reply (user, metadata, store, service_tier, ...) are
ignored; the ones that would change what is sampled, which tandem's engines do not do (logit_bias,
penalties, seed, top_k, echo, ...), are refused unless they hold their neutral value
(`NOT_SAMPLED`), never ignored; so are structured outputs (`response_format` other than text,
vLLM's and SGLang's `CONSTRAINED` fields), chat's `max_completion_tokens` on completions, and
`max_tokens` and `max_completion_tokens` that differ on chat. NaN, Infinity and lone surrogates
are refused anywhere (see bodies.py). Every number is bounded, so a bad value is a 422 naming its
field before anything reaches the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tandem.episodes import EPISODE_ID as episode_ids
from tandem_inference.bodies import MAX_TOP_LOGPROBS, Body, ChatLogprobs, Part

#: Most samples one request may ask for (`n`).
MAX_N = 64
#: `max_tokens` when a request names none (never above settings.engine.max_new_tokens_limit).
DEFAULT_MAX_TOKENS = 128
MAX_MODEL_CHARS = 256
#: Most `stop_token_ids` one request may give.
MAX_STOP_TOKEN_IDS = 64
"""Longest `model` accepted: a run name (63), `@v` and a version fit many times over."""
EPISODE_ID = episode_ids.pattern
"""What an episode id may be (the client checks the same pattern): it becomes part of a Redis key and a URL path."""
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
"""What a function name may be (OpenAI's rule)."""

#: OpenAI's (and vLLM's and SGLang's) request fields that change what is sampled, which tandem's
#: engines do not honour: field -> its neutral values, said as a client would write them. A field
#: at a neutral value is accepted (clients send defaults); any other value is refused naming it.
NOT_SAMPLED: dict[str, tuple[tuple[Any, ...], str]] = {
    "logit_bias": ((None, {}), "{}"),
    "presence_penalty": ((None, 0), "0"),
    "frequency_penalty": ((None, 0), "0"),
    "repetition_penalty": ((None, 1), "1"),
    "seed": ((None,), "null"),
    "top_k": ((None, 0, -1), "-1"),
    "min_p": ((None, 0), "0"),
    "best_of": ((None, 1), "1"),
    "echo": ((None, False), "false"),
    "suffix": ((None, ""), "null"),
    "prediction": ((None,), "null"),
    "audio": ((None,), "null"),
    "modalities": ((None, ["text"]), '["text"]'),
    "reasoning_effort": ((None,), "null"),
    "parallel_tool_calls": ((None, True), "true"),
    "functions": ((None, []), "null (describe them in `tools`)"),
    "function_call": ((None,), "null (use `tool_choice`)"),
    # vLLM's and SGLang's own sampling extensions, which their clients send in the body
    "ignore_eos": ((None, False), "false"),
    "min_tokens": ((None, 0), "0"),
    "include_stop_str_in_output": ((None, False), "false"),
}


#: vLLM's and SGLang's structured-output fields, which their clients send in the body: each would
#: constrain decoding to a schema, a pattern, a list or a grammar, which tandem's engines do not do.
#: Field -> what it holds. Any value but null is refused naming the field, on chat and completions.
CONSTRAINED: dict[str, str] = {
    "guided_json": "vLLM's JSON schema",
    "guided_regex": "vLLM's regular expression",
    "guided_choice": "vLLM's list of choices",
    "guided_grammar": "vLLM's grammar",
    "structured_outputs": "vLLM's structured-output constraint",
    "json_schema": "SGLang's JSON schema",
    "regex": "SGLang's regular expression",
    "ebnf": "SGLang's EBNF grammar",
}
UNCONSTRAINED = ("tandem's engines do not constrain decoding (to a JSON schema, a pattern, a list of choices or a "
                 "grammar), and the field would change what the reply means")
"""Why a structured-output field is refused, never ignored."""


def refuse_unless_neutral(name: str, value: Any) -> Any:
    """`value` of the `NOT_SAMPLED` field `name` if it is neutral; else a ValueError saying why."""
    neutral, said = NOT_SAMPLED[name]
    if any(_same(value, n) for n in neutral):
        return value
    raise ValueError(f"{name}={json.dumps(value)[:80]} is not supported: tandem's engines sample with temperature, "
                     f"top_p, stop and max tokens only, and the field would change what is sampled; leave it out "
                     f"(or send {said})")


def _same(value: Any, neutral: Any) -> bool:
    """`value` equals `neutral` as JSON sees it: 0 and 0.0 alike, but true is no 1 and false no 0."""
    number = (int, float)
    if isinstance(value, bool) or isinstance(neutral, bool) or not (isinstance(value, number) and isinstance(neutral, number)):
        return type(value) is type(neutral) and value == neutral
    return bool(value == neutral)


Kind = Literal["chat", "text"]
"""Which API a request came in by: chat completions or (text) completions."""


class TextPart(Part):
    type: Literal["text"]
    text: str


class FunctionSpec(Part):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema."""
    strict: bool | None = None
    """Only false or absent: arguments that must follow the schema need constrained decoding."""

    @field_validator("strict")
    @classmethod
    def _not_strict(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("strict=true is not supported: tandem's engines do not constrain decoding to the "
                             "function's parameters schema; leave strict out (or false) and validate the arguments")
        return value


class Tool(Part):
    """A tool the model may call: OpenAI's `{"type": "function", "function": {...}}`."""

    type: Literal["function"]
    function: FunctionSpec

    def as_template_input(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class FunctionName(Part):
    name: str = Field(pattern=TOOL_NAME)


class NamedToolChoice(Part):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Part):
    name: str = Field(min_length=1)
    arguments: str
    """The arguments as a JSON text, as OpenAI sends them."""


class ToolCall(Part):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Part):
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
        """The message as chat templates take it: text content, calls with their arguments as objects;
        a `developer` message as the `system` one it is to models of OpenAI's older chat format."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
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


class StreamOptions(Part):
    include_usage: bool = False
    """A last chunk, without choices, carries the usage (OpenAI's; none is sent otherwise)."""


class SamplingRequest(Body):
    """What chat and completion requests share: the model, sampling, `n`, stops, streaming."""

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N, strict=True)
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    best_of: Any = None
    echo: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    include_stop_str_in_output: Any = None
    """`NOT_SAMPLED`: refused unless neutral, on chat and completions alike (vLLM and SGLang
    clients send top_k, min_p and repetition_penalty in the body)."""
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    """vLLM's and SGLang's extension: token ids that end a sample as EOS does (the engine checks
    each is in its vocabulary)."""
    response_format: dict[str, Any] | None = None
    """Only `{"type": "text"}` (the default): structured outputs are refused, never ignored."""
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    """`CONSTRAINED`: refused unless null, on chat and completions alike."""

    @field_validator(*NOT_SAMPLED, mode="after", check_fields=False)
    @classmethod
    def _not_sampled(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_unless_neutral(str(info.field_name), value)

    @field_validator("response_format")
    @classmethod
    def _no_structured_output(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = value.get("type") if isinstance(value, dict) else None
        if value is not None and kind != "text":
            raise ValueError(f"response_format type {kind!r} is not supported: {UNCONSTRAINED}; leave "
                             "response_format out (or {\"type\": \"text\"}) and ask for JSON in the prompt, then "
                             "parse the reply")
        return value

    @field_validator(*CONSTRAINED)
    @classmethod
    def _not_constrained(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            name = str(info.field_name)
            raise ValueError(f"{name} ({CONSTRAINED[name]}) is not supported: {UNCONSTRAINED}; leave {name} out "
                             "(or null), ask for the format in the prompt and check the reply")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and "stream" in info.data and info.data["stream"] is not True:  # (absent: refused itself)
            raise ValueError("stream_options is only allowed with stream: true (as OpenAI's API has it); "
                             "send stream: true, or leave stream_options out")
        return value

    @property
    def alternatives_per_token(self) -> int:
        """How many alternatives per token the reply lists (0: none)."""
        return 0


class ChatRequest(ChatLogprobs, SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    """OpenAI's newer name for `max_tokens` on chat; both may be sent only with the same value."""
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    """Alternatives per token in `logprobs.content[].top_logprobs`; needs `logprobs: true`."""
    tools: list[Tool] | None = None
    """Functions the model may call; handed to the chat template."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """`none` leaves the tools out of the prompt, `auto` (or none) renders them; a forced choice is refused."""
    episode: str | None = Field(None, pattern=EPISODE_ID)
    """The multi-turn episode this request continues (or starts): see gateway/episodes.py."""
    episode_id: Any = None
    """The client's name of `episode` (`Run.episode(episode_id=...)`): refused, naming `episode`,
    since ignored like other unknown fields it would serve the turn and keep no episode."""
    parallel_tool_calls: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    functions: Any = None
    function_call: Any = None
    """`NOT_SAMPLED`: refused unless neutral."""

    @field_validator("max_completion_tokens")
    @classmethod
    def _agrees_with_max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")  # (invalid: refused itself)
        if value is not None and other is not None and value != other:
            raise ValueError(f"max_tokens {other} and max_completion_tokens {value} differ: they are two names of "
                             "one limit (max_completion_tokens the newer); send one of them, or the same value in both")
        return value

    @field_validator("episode_id")
    @classmethod
    def _episode_is_the_field(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("the gateway's field for an episode's id is `episode`, not `episode_id`; send "
                             "\"episode\": <id> (the turn was not served, so that no episode is lost)")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_not_forced(cls, value: Any) -> Any:
        if value == "required" or isinstance(value, NamedToolChoice):
            said = "'required'" if value == "required" else f"the function {value.function.name!r}"
            raise ValueError(f"tool_choice {said} is not supported: tandem's engines do not constrain decoding, so "
                             "a tool call cannot be forced and the field would change what the reply means; send "
                             "'auto' (or leave it out) and check the reply's tool_calls")
        return value

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders: none with `tool_choice: "none"`."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.as_template_input() for t in self.tools]


#: Chat's fields, each refused on the completions API unless null (never ignored), saying what to do instead.
CHAT_ONLY = {
    "max_completion_tokens": "max_completion_tokens is not a field of the completions API (only chat completions "
                             "take it); send max_tokens, the completions API's field, instead",
    "episode": "episode: episodes are turns of messages, served by /v1/chat/completions only; send the turn there "
               "(\"episode\": <id>), or leave the field out",
    "episode_id": "episode_id: episodes are turns of messages, served by /v1/chat/completions only; send the turn "
                  "there (\"episode\": <id>), or leave the field out",
}


class CompletionRequest(SamplingRequest):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)]
    suffix: Any = None
    """`NOT_SAMPLED`: refused unless neutral."""
    max_completion_tokens: Any = None
    episode: Any = None
    episode_id: Any = None
    """`CHAT_ONLY`: chat's fields, refused unless null, never ignored."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    """OpenAI's completions API takes a count here: any value asks for logprobs, and that many
    alternatives per token come back in `top_logprobs`."""

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and any(isinstance(p, (str, list)) for p in value):
            raise ValueError("a batch of prompts (a list of strings or of token-id lists) is not served; send one "
                             "prompt per request, a string or one list of token ids (n asks for several samples)")
        return value

    @field_validator(*CHAT_ONLY)
    @classmethod
    def _chat_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(CHAT_ONLY[info.field_name or ""])
        return value

    @property
    def alternatives_per_token(self) -> int:
        return self.logprobs or 0
