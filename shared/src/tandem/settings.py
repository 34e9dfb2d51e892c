"""Settings of every tandem service, one pydantic-settings class per service.

Environment variables use the prefix `TANDEM_` and `__` for nesting, for example
`TANDEM_REDIS__URL` or `TANDEM_ENGINE__MAX_LORA_RANK`. A shared `.env` file is read too;
keys that belong to another service are ignored, not fatal. Each service prints its
resolved settings, secrets redacted, with `tandem settings <service>`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import redis
from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.errors import BackendUnavailable


class RedisSettings(BaseModel):
    """Where Redis is."""

    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL (`redis://[:password@]host:port/db`)."""
    password: SecretStr | None = None
    """Password, if not in the URL."""
    socket_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Timeout of one Redis command, in seconds (blocking reads add their own block time)."""

    def connect(self) -> redis.Redis:
        """Open a client; raises BackendUnavailable naming the URL when Redis does not answer."""
        client = redis.Redis.from_url(
            self.url,
            password=self.password.get_secret_value() if self.password else None,
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=min(self.socket_timeout_s, 10.0),
        )
        try:
            client.ping()
        except redis.RedisError as exc:
            raise BackendUnavailable(
                f"Redis at {self.url!r} does not answer ({exc}); start it or set TANDEM_REDIS__URL"
            ) from exc
        return client


class StoreSettings(BaseModel):
    """The adapter volume."""

    root: Path = Path(".tandem/adapters")
    """Directory that holds every adapter version; shared by trainer (rw) and inference (ro)."""


class EngineSettings(BaseModel):
    """The inference engine (SGLang, or the transformers engine on CPU)."""

    kind: Literal["transformers", "sglang"] = "transformers"
    """Which engine serves rollouts."""
    url: str = "http://127.0.0.1:30000"
    """Base URL of the engine's HTTP API (private: never publish it)."""
    model: str = ".tandem/models/tiny"
    """Base model: a local path or a hub id."""
    served_model_name: str = "base"
    """Name the engine serves the base model under; no ':' allowed."""
    host: str = "127.0.0.1"
    """Interface the transformers engine binds to."""
    port: int = Field(30000, ge=1, le=65535)
    """Port the transformers engine binds to."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the transformers engine."""
    max_lora_rank: int = Field(64, ge=1, le=1024)
    """Largest LoRA rank the engine accepts; larger adapters are rejected."""
    max_loaded_adapters: int = Field(8, ge=1, le=256)
    """How many adapters the engine holds at once."""
    admin_api_key: SecretStr | None = None
    """Key that guards load/unload and memory routes of the engine."""
    load_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Timeout of one adapter load, in seconds."""
    unload_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Timeout of one adapter unload, in seconds."""
    generate_timeout_s: float = Field(300.0, gt=0, le=86400)
    """Timeout of one generation request, in seconds."""
    max_new_tokens_limit: int = Field(4096, ge=1)
    """Largest `max_tokens` a request may ask for."""

    @model_validator(mode="after")
    def _no_colon(self) -> EngineSettings:
        if ":" in self.served_model_name:
            raise ValueError(
                f"engine.served_model_name {self.served_model_name!r} contains ':'; "
                "SGLang splits OpenAI model names at ':'"
            )
        return self


class ControllerSettings(BaseModel):
    """The inference controller that follows the event stream and loads adapters."""

    consumer: str = "inference"
    """Name of the controller's cursor on the event stream."""
    keep_versions: int = Field(2, ge=1, le=64)
    """How many newest versions per run stay loaded (older ones are unloaded when idle)."""
    block_ms: int = Field(1000, ge=1, le=60000)
    """How long one blocking read of the event stream waits, in milliseconds."""


class GatewaySettings(BaseModel):
    """The OpenAI-compatible gateway."""

    host: str = "127.0.0.1"
    """Interface the gateway binds to."""
    port: int = Field(8000, ge=1, le=65535)
    """Port the gateway binds to (the only published port of the stack)."""
    api_key: SecretStr | None = None
    """When set, requests need `Authorization: Bearer KEY`."""


class TrainerBackendSettings(BaseModel):
    """How the trainer runs the model."""

    kind: Literal["auto", "peft", "unsloth"] = "auto"
    """`auto` picks Unsloth when it imports and CUDA is there, else peft."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one micro-batch (padded tokens); larger batches accumulate gradients."""


_CONFIG = SettingsConfigDict(
    env_prefix="TANDEM_", env_nested_delimiter="__", env_file=".env", extra="ignore"
)


class _ServiceSettings(BaseSettings):
    model_config = _CONFIG

    redis: RedisSettings = RedisSettings()
    store: StoreSettings = StoreSettings()

    def redacted(self) -> dict[str, Any]:
        """The resolved settings as JSON-able data, secrets shown as '**********'."""
        return json.loads(self.model_dump_json())


class TrainerSettings(_ServiceSettings):
    """Settings of the trainer worker (`tandem-trainer`)."""

    backend: TrainerBackendSettings = TrainerBackendSettings()
    job_timeout_s: int = Field(1800, ge=1, le=86400)
    """Default timeout of one train job, in seconds (a job may set its own)."""
    worker_name: str | None = None
    """rq worker name; default: host and pid."""


class InferenceSettings(_ServiceSettings):
    """Settings of the inference side: engine, controller and gateway."""

    engine: EngineSettings = EngineSettings()
    controller: ControllerSettings = ControllerSettings()
    gateway: GatewaySettings = GatewaySettings()


class ClientSettings(_ServiceSettings):
    """Settings of the client SDK (`tandem.Client`)."""

    gateway_url: str = "http://127.0.0.1:8000"
    """Base URL of the gateway."""
    api_key: SecretStr | None = None
    """Gateway API key, if the gateway needs one."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Timeout of one rollout request, in seconds."""
    train_timeout_s: float = Field(1800.0, gt=0)
    """How long a synchronous `train()` waits for the new version to serve, in seconds."""
