"""Request bodies of the engine's routes (SGLang's and OpenAI's shapes), and what they ask of the sampler.

SGLang accepts many more fields: unknown ones are ignored. NaN, Infinity and lone surrogates
are refused anywhere (see bodies.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from tandem_inference.bodies import MAX_TOP_LOGPROBS, Body, ChatLogprobs
from tandem_inference.engines.transformers.sampling import SamplingParams
from tandem_inference.errors import InvalidRequest

MEMORY_TAGS = {"weights", "kv_cache", "cuda_graph"}
"""What SGLang's memory routes can release; this engine releases all of them at once."""


class SamplingBody(Body):
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    sampling_seed: int | None = None


class GenerateBody(Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingBody = SamplingBody()
    return_logprob: bool = False
    logprob_start_len: int = -1  # accepted; only output-token logprobs are returned
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives per output token in meta_info.output_top_logprobs (with return_logprob)."""
    stream: bool = False
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None  # adapter NAME(s); None = base model


class OpenAIBody(Body):
    """What OpenAI's chat and completions bodies share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False  # extension (vLLM's name): token ids in every choice

    @property
    def alternatives_per_token(self) -> int:
        """How many alternatives per token the reply lists (0: none)."""
        return 0

    @property
    def adapter(self) -> str | None:
        """SGLang's rule: `<served>:<adapter>` picks an adapter, anything else the base model."""
        return (self.model.split(":", 1)[1] or None) if self.model and ":" in self.model else None


class ChatBody(ChatLogprobs, OpenAIBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionBody(OpenAIBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and SGLang's default for completions
    logprobs: bool | Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """true/false, or OpenAI's count: logprobs, and that many alternatives per token."""

    @property
    def alternatives_per_token(self) -> int:
        return 0 if isinstance(self.logprobs, bool) else self.logprobs or 0


class LoadBody(Body):
    lora_name: str
    lora_path: str
    pinned: bool = False  # accepted; nothing is evicted here, so every adapter is pinned


class UnloadBody(Body):
    lora_name: str


class WeightsBody(Body):
    model_path: str
    load_format: str | None = None  # None, "auto" or "safetensors": what this engine reads
    flush_cache: bool = True  # accepted; no cross-request prefix cache to empty
    abort_all_requests: bool = False
    weight_version: str | None = None


class MemoryBody(Body):
    tags: list[str] | None = None


def sampling_params(
    max_new_tokens: int | None,
    *,
    limit: int,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    n: int = 1,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    seed: int | None = None,
    top_logprobs: int = 0,
) -> SamplingParams:
    """Checked sampler settings from a request's fields (None: the default); `limit` is
    engine.max_new_tokens_limit."""
    if max_new_tokens is not None and max_new_tokens > limit:
        raise InvalidRequest(
            f"max_new_tokens={max_new_tokens} exceeds the server limit {limit} (engine.max_new_tokens_limit)"
        )
    default = SamplingParams()
    return SamplingParams(
        max_new_tokens=default.max_new_tokens if max_new_tokens is None else max_new_tokens,
        temperature=default.temperature if temperature is None else temperature,
        top_p=default.top_p if top_p is None else top_p,
        top_k=default.top_k if top_k is None else top_k,
        min_p=default.min_p if min_p is None else min_p,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=tuple(stop_token_ids or ()),
        n=n,
        ignore_eos=ignore_eos,
        seed=seed,
        top_logprobs=top_logprobs,
    ).check()
