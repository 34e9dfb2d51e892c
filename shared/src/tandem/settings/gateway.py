"""The OpenAI-compatible gateway's section (`TANDEM_GATEWAY__*`): where it listens, its key, its
admission limits and episodes."""

from __future__ import annotations

from pydantic import BaseModel, Field

from tandem.settings.secret import Secret
from tandem.settings.section import SECTION


class GatewaySettings(BaseModel):
    """The OpenAI-compatible gateway."""

    model_config = SECTION

    host: str = "127.0.0.1"
    """Interface the gateway binds to."""
    port: int = Field(8000, ge=1, le=65535)
    """Port the gateway binds to (the only published port of the stack)."""
    api_key: Secret = None
    """When set, requests need `Authorization: Bearer KEY`."""
    max_body_bytes: int = Field(4 * 2**20, ge=1024, le=2**30)
    """Largest request body the gateway reads, in bytes; a larger one is refused with 413 before it
    is parsed (a 32k-token conversation is about 130 kB of text)."""
    max_in_flight_sequences: int = Field(256, ge=1, le=65536)
    """Most samples (each request's `n`) admitted to the engine at once; more wait in the queue."""
    max_in_flight_tokens: int = Field(8192, ge=1, le=2**31 - 1)
    """Most tokens admitted to the engine at once, counted as `n * max_tokens` of each request;
    more wait in the queue. It bounds the engine's backlog, so what a small request waits: sized
    for the CPU engine, which runs one batch at a time; raise it for SGLang on a GPU (compose.yaml does)."""
    max_queued_requests: int = Field(128, ge=0, le=65536)
    """Requests that may wait for room; one more is refused at once with 429 and Retry-After."""
    queue_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Longest a request waits in the queue for room before it is refused with 429, in seconds."""
    retry_after_s: int = Field(2, ge=1, le=3600)
    """Seconds a refused client is told to wait before it retries (the Retry-After header)."""
    run_max_in_flight_sequences: int | None = Field(None, ge=1, le=65536)
    """Most samples (each request's `n`) one run may have in flight at once, waiting for room or
    generating: its quota of concurrent rollouts. A run's requests beyond it wait for a turn of their
    run (the other runs' requests do not wait behind them); a request of more samples than this runs
    once its run has nothing else in flight. Unset, a run may take the whole of
    `max_in_flight_sequences` (one run alone uses the engine fully); set it below that when several
    runs share the gateway and one's burst must not fill it. The base model's requests are bounded by
    `max_in_flight_sequences` only."""
    run_queue_timeout_s: float = Field(300.0, gt=0, le=3600)
    """Longest a request beyond its run's quota (`run_max_in_flight_sequences`) waits for a turn of its
    run, in seconds; past it it is refused with 429 (`run_quota_timeout`) and Retry-After."""
    run_max_queued_requests: int = Field(1024, ge=1, le=65536)
    """Most requests of one run that may wait for a turn of their run at once; one more is refused at
    once with 429 (`run_queue_full`) and Retry-After. It bounds what one run parks in the gateway's memory."""
    published_host: str | None = None
    """Host address the gateway's port is published on when it runs in a container (compose sets it
    from GATEWAY_BIND); the check for serving beyond loopback without `api_key` reads it instead of
    `host`."""
    allow_unauthenticated: bool = False
    """Serve without `api_key` on an address beyond loopback. Off: the inference service refuses to
    start that way."""
    metrics_run_names: bool = False
    """Name runs on `/metrics` to a scrape without `api_key` too. Off: when `api_key` is set, a scrape
    without it sees each run as `run-` and 12 hex digits (keyed by `api_key`: the same on every
    replica); with the key, or without `api_key` set, the names."""
    fan_out_n: bool = False
    """Send a request's `n` samples as n engine calls instead of one call with `sampling_params.n`.
    Off: one call on every engine. SGLang 0.5.12's unload deadlocked after one-call n>1 sampling
    (sglang#36894); the pinned 0.5.23 unloads at once after it (docs/benchmarks.md, "SGLang 0.5.23").
    On is the way back for an engine that still deadlocks."""
    episode_ttl_s: float = Field(3600.0, gt=0, le=7 * 24 * 3600)
    """How long the gateway keeps a multi-turn episode after its last turn, in seconds; a later
    continuation is refused with 404 and the agent starts a new episode."""
    episode_max_tokens: int | None = Field(None, ge=16, le=2**24)
    """Most token ids one episode may hold (prompt, every turn and what the next turn may sample),
    in tokens; a turn that would pass it is refused with 400. Unset: the engine's context length
    (its server info's `context_length`), or 32768 where the engine does not say."""
