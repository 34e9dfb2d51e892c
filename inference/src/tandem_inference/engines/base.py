"""What tandem asks of an engine, and what an engine gives back, in tandem's own words.

The gateway and the controller know engines only through `Engine`: generate (whole or streamed),
load and unload adapters, list them, health and limits, the prefix cache, lending GPU memory
(release/resume), full-weight reloads, and the engine's own metrics (which the gateway relays).
Each engine's wire format — its routes, field names and error shapes — stays inside its own
implementation (`engines/sglang*`, `engines/vllm*`, `engines/transformers/`), which turns
requests into its calls and its replies into `Generated` and the errors of `tandem_inference.errors`.

Logprobs follow tandem's convention (`tandem.logprobs`): under the temperature-scaled policy
that sampled the token (the unscaled distribution for greedy decoding).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]

METRICS_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
"""What `Engine.metrics` returns, as a content type: Prometheus' text exposition format 0.0.4."""

TopLogprobs = list[tuple[float, int, str | None]]
"""The alternatives at one position, best first: (logprob, token id, token text or None)."""


@dataclass(frozen=True)
class Sampling:
    """How to sample one request's completions."""

    max_tokens: int
    """Most new tokens per sample."""
    temperature: float = 1.0
    """0 is greedy decoding."""
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    """Strings that end a sample; the engine leaves them out of its text."""
    top_logprobs: int = 0
    """Alternatives listed per position (0: none)."""
    ignore_eos: bool = False
    """Generate all `max_tokens` even past the end-of-sequence token (probes and benchmarks)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample as EOS does (the token is the sample's last): Tinker's integer stops."""


@dataclass
class Generated:
    """Tokens an engine produced for one sample: a whole completion, or what one streamed chunk added.

    In a stream every field is an increment (the ids, logprobs and text that chunk added), so a
    consumer appends them; an engine whose wire format repeats everything so far, or revises the
    text's tail (an incomplete UTF-8 character), turns that into increments before handing it out.
    """

    index: int = 0
    """Which of the request's n samples this is."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """One per token when logprobs were asked for, else empty."""
    token_texts: list[str | None] = field(default_factory=list)
    """Each token's text where the engine sent it (parallel to `logprobs`)."""
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    """Per token, the alternatives the engine listed (None where it listed none)."""
    text: str = ""
    finish_reason: FinishReason | None = None
    """Set once the sample ended: its stop (a stop string, EOS) or its length limit."""
    cached_tokens: int | None = None
    """Prompt tokens the engine's prefix cache served, where the engine says."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine says about itself; None where it does not say."""

    context_length: int | None = None
    """Longest sequence (prompt plus completion), in tokens."""
    max_lora_rank: int | None = None
    """Highest LoRA rank it can load."""


class Engine(Protocol):
    """One engine serving the base model and its adapters, as the gateway and the controller use it.

    Generation and the rest travel in separate connection pools, so loads, unloads and health
    checks never wait behind rollouts. Failures are `tandem_inference.errors`: EngineUnreachable
    (EngineTimeout), EngineResponseError (AdapterLoadRefused).
    """

    url: str
    """Where the engine answers (for messages and logs; never shown to clients)."""

    async def complete(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, n: int = 1, adapter: str | None = None,
        logprobs: bool = True,
    ) -> list[Generated]:
        """`n` whole samples of one prompt, in sample order (`adapter` None: the base model)."""
        ...

    def stream(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, n: int = 1, adapter: str | None = None,
        logprobs: bool = True,
    ) -> AsyncGenerator[Generated, None]:
        """Increments of `n` samples as the engine produces them (interleaved, each naming its index).

        Closing the generator ends the engine's work on it.
        """
        ...

    async def load_adapter(self, name: str, path: str) -> float:
        """Load the adapter directory `path` under the new name `name`; returns the load time in ms."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Unload `name`, after the requests that use it finished."""
        ...

    async def loaded_adapters(self) -> dict[str, str]:
        """Adapters the engine holds now: name -> path."""
        ...

    async def health(self) -> bool:
        """Whether the engine answers now; never raises for a down engine."""
        ...

    async def info(self) -> EngineInfo:
        """The engine's limits."""
        ...

    async def flush_cache(self) -> None:
        """Drop the prefix cache (after the base weights changed)."""
        ...

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (all of it, or only `tags`: "weights", "kv_cache") for a trainer on the same GPU."""
        ...

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back what `release_memory` freed."""
        ...

    async def metrics(self) -> str:
        """The engine's own Prometheus metrics, as it names them, in `METRICS_FORMAT`.

        Read once, within a few seconds and a few MiB (engines/calls.py); an engine that answers
        more, or not at all, raises (EngineResponseError, EngineUnreachable).
        """
        ...

    async def update_weights(self, model_path: str, *, abort_all_requests: bool = False,
                             version: str | None = None) -> str:
        """Load a checkpoint of the same architecture into the base model in place; the engine's message.

        A refusal (the old weights keep serving) raises EngineResponseError.
        """
        ...
