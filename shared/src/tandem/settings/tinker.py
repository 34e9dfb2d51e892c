"""The Tinker service's section (`TANDEM_TINKER__*`): where it listens, where it reaches the gateway,
and how long its futures wait and live.

The service serves Tinker's training and sampling API (`tinker` SDK) over tandem: it listens on
loopback by default and takes the gateway's API key (`TANDEM_GATEWAY__API_KEY`), which the SDK
sends as `tml-KEY` (the SDK refuses a key without that prefix) or as the key itself.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tandem.settings.section import SECTION


class TinkerServiceSettings(BaseModel):
    """The Tinker-compatible service."""

    model_config = SECTION

    host: str = "127.0.0.1"
    """Interface the service binds to."""
    port: int = Field(8100, ge=1, le=65535)
    """Port the service binds to."""
    published_host: str | None = None
    """Host address the service's port is published on when it runs in a container (compose sets it
    from TINKER_BIND); the check for serving beyond loopback without the gateway's API key reads it
    instead of `host`."""
    gateway_url: str = "http://127.0.0.1:8000"
    """Base URL of tandem's gateway, through which the service samples (with the gateway's API key)."""
    sample_timeout_s: float = Field(300.0, gt=0, le=3600)
    """Longest one sampling request to the gateway may take, in seconds."""
    poll_wait_s: float = Field(5.0, ge=0, le=30)
    """How long one `retrieve_future` waits for a pending future before it answers try-again, in
    seconds (the SDK polls again at once; the SDK's own request timeout is 45 s)."""
    future_ttl_s: int = Field(7 * 24 * 3600, ge=60, le=90 * 24 * 3600)
    """How long a future, its result and a session's state live in Redis after they were written, in seconds."""
    max_body_bytes: int = Field(64 * 2**20, ge=1024, le=2**31 - 1)
    """Largest request body the service reads (after zstd decompression), in bytes; a larger one is refused with 413."""
    run_max_queued_jobs: int = Field(32, ge=1, le=10_000)
    """Most jobs of one model (run) waiting on the train queue: a training call beyond it is parked
    with the model's requests that wait their turn, its future pending, and enqueued in seq_id order
    once a poll of the model's futures finds room (tandem.job_quota); nothing is refused for it."""
    max_lora_rank: int = Field(64, ge=1, le=1024)
    """Highest LoRA rank `create_model` accepts (the engines must load it: `engine.max_lora_rank`)."""
