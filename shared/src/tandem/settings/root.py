"""The settings of each service, composed of the sections below them: the trainer, the inference
service and the client; with the environment they are read from (prefix `TANDEM_`, `__` for
nesting, a shared `.env`), their cross-section rules and their redacted form."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, cast

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.settings.controller import ControllerSettings, ReplicaSettings
from tandem.settings.engine import EngineSettings
from tandem.settings.gateway import GatewaySettings
from tandem.settings.gpus import GpuSettings
from tandem.settings.secret import Secret, redact_url
from tandem.settings.section import SECTION
from tandem.settings.storage import RedisSettings, RetentionSettings, StoreSettings
from tandem.settings.tinker import TinkerServiceSettings
from tandem.settings.trainer import (
    ParallelSettings,
    TrackerSettings,
    TrainerBackendSettings,
    TrainerMetricsSettings,
)

#: Where `tandem up` (run from this directory) writes the gateway and Redis URLs of its stack.
LOCAL_STACK_ENV = ".tandem/stack/client.env"

_CONFIG = SettingsConfigDict(
    env_prefix="TANDEM_", env_nested_delimiter="__", env_file=".env", extra="ignore",
    use_attribute_docstrings=SECTION["use_attribute_docstrings"], allow_inf_nan=SECTION["allow_inf_nan"],
)


class _ServiceSettings(BaseSettings):
    model_config = _CONFIG

    redis: RedisSettings = RedisSettings()
    store: StoreSettings = StoreSettings()

    def redacted(self) -> dict[str, Any]:
        """The resolved settings as JSON-able data, secrets shown as '**********' and the password
        of every URL (Redis's, the gateway's, MLflow's, ...) as '***'."""
        return cast(dict[str, Any], _urls_redacted(json.loads(self.model_dump_json())))


class TrainerSettings(_ServiceSettings):
    """Settings of the trainer worker (`tandem-trainer`)."""

    gpus: GpuSettings = GpuSettings()
    backend: TrainerBackendSettings = TrainerBackendSettings()
    job_timeout_s: int = Field(1800, ge=1, le=86400)
    """Default timeout of one train job, in seconds (a job may set its own)."""
    worker_name: str | None = None
    """rq worker name; default: host and pid."""
    redis_outage_s: float = Field(300.0, ge=0, le=86400)
    """How long the trainer rides out a Redis outage, in seconds: each Redis command that fails
    because Redis is away is tried again, with pauses growing to 2 s, for up to this long, so a job
    that ends while Redis is away completes once Redis is back; past it the worker exits and its
    restart recovers the job."""
    liveness_ttl_s: float = Field(8.0, ge=2.0, le=300.0)
    """How long the trainer's liveness key outlives its last refresh, in seconds (it is refreshed
    every quarter of this): a trainer that died is known dead this long after, and the jobs it
    held go back to the queue; a restarted trainer under the same name waits as long for it.
    Every trainer of one Redis should have the same; shorter hands jobs back sooner, but a trainer
    stalled for longer than this is taken for dead."""
    parallel: ParallelSettings = ParallelSettings()
    metrics: TrainerMetricsSettings = TrainerMetricsSettings()
    tracker: TrackerSettings = TrackerSettings()
    retention: RetentionSettings = RetentionSettings()

    @model_validator(mode="after")
    def _ranks_fit_gpus(self) -> TrainerSettings:
        ranks = self.parallel.ranks
        if self.parallel.nodes > 1 and self.gpus.mode == "shared":
            raise ValueError(
                f"parallel.nodes={self.parallel.nodes} in shared mode: the trainer shares the one "
                "inference GPU; training on several nodes needs split (or cpu) mode"
            )
        if ranks is None or ranks == 1:
            return self
        if self.gpus.mode == "shared":
            raise ValueError(
                f"parallel.ranks={ranks} in shared mode: the trainer shares the one inference GPU; "
                "data-parallel training needs split mode with several gpus.trainer"
            )
        if self.gpus.mode == "split" and ranks != len(self.gpus.trainer):
            raise ValueError(
                f"parallel.ranks={ranks} but gpus.trainer={self.gpus.trainer} names "
                f"{len(self.gpus.trainer)} GPU(s); a rank trains on one GPU each, so leave "
                "parallel.ranks unset or list as many trainer GPUs"
            )
        return self


class InferenceSettings(_ServiceSettings):
    """Settings of the inference side: engine, controller and gateway."""

    gpus: GpuSettings = GpuSettings()
    engine: EngineSettings = EngineSettings()
    controller: ControllerSettings = ControllerSettings()
    gateway: GatewaySettings = GatewaySettings()
    replica: ReplicaSettings = ReplicaSettings()

    @model_validator(mode="after")
    def _replica_url(self) -> InferenceSettings:
        """Unset `replica.url`: this host's name and the gateway's port."""
        if self.replica.url is None:
            self.replica = self.replica.model_copy(
                update={"url": f"http://{socket.gethostname()}:{self.gateway.port}"})
        return self

    @model_validator(mode="after")
    def _engine_roots(self) -> InferenceSettings:
        """Unset engine roots: the adapter store, and the directory that holds a local base model."""
        if self.engine.adapter_roots is None:
            self.engine = self.engine.model_copy(update={"adapter_roots": [self.store.root]})
        if self.engine.weights_roots is None:
            model = Path(self.engine.model)
            roots = [model.resolve().parent] if model.exists() else []
            self.engine = self.engine.model_copy(update={"weights_roots": roots})
        return self


class ClientSettings(_ServiceSettings):
    """Settings of the client SDK (`tandem.Client`)."""

    # `tandem up` writes the URLs of the stack it started (Redis with its password) to
    # LOCAL_STACK_ENV; a `.env` and the environment override them.
    model_config = SettingsConfigDict(**{**_CONFIG, "env_file": (LOCAL_STACK_ENV, ".env")})

    gateway_url: str = "http://127.0.0.1:8000"
    """Base URL of the gateway."""
    api_key: Secret = None
    """Gateway API key, if the gateway needs one."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Timeout of one rollout request, in seconds."""
    train_timeout_s: float = Field(1800.0, gt=0)
    """How long a synchronous `train()` waits for the new version to serve, in seconds."""
    run_max_queued_jobs: int = Field(32, ge=1, le=10_000)
    """Most jobs of one run waiting on the train queue: a `train()` beyond it waits for the trainer to
    take one of them (tandem.job_quota) instead of enqueueing; nothing is refused for it."""
    queue_wait_s: float = Field(1800.0, gt=0, le=7 * 24 * 3600)
    """Longest a `train()` waits for room on the queue (`run_max_queued_jobs`), in seconds; past it
    it raises RunQueueFull (no trainer took one of the run's jobs all that time)."""
    silent_replica_s: float = Field(15.0, gt=0, le=3600)
    """Once a replica serves the new version, how long `train()` still waits for a ready replica
    that said nothing of it (neither held, served nor refused it), in seconds; then it is not
    waited for. One that a serving replica went on without (after `replica.agree_s`, 10 s: its
    `adapter_loaded` names it) is not waited for from then on."""


class TinkerSettings(_ServiceSettings):
    """Settings of the Tinker-compatible service (`tandem-tinker`): its own section, and the
    gateway's, whose API key it takes."""

    tinker: TinkerServiceSettings = TinkerServiceSettings()
    gateway: GatewaySettings = GatewaySettings()


SERVICES: dict[str, type[_ServiceSettings]] = {
    "trainer": TrainerSettings,
    "inference": InferenceSettings,
    "client": ClientSettings,
    "tinker": TinkerSettings,
}


def _urls_redacted(value: Any) -> Any:
    """`value` (JSON-able settings data) with the password of every URL in it as '***'."""
    if isinstance(value, dict):
        return {k: _urls_redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_urls_redacted(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value
