"""Settings of every tandem service, one pydantic-settings class per service.

Environment variables use the prefix `TANDEM_` and `__` for nesting, for example
`TANDEM_REDIS__URL` or `TANDEM_ENGINE__MAX_LORA_RANK`. A shared `.env` file is read too;
keys that belong to another service are ignored, not fatal. Each service prints its
resolved settings, secrets redacted, with `tandem settings <service>`.

A module per section, each importing only from those above it in this list; `root` composes
them into the settings of each service:

    section     what every section shares: docstrings as descriptions, finite numbers only
    secret      the optional secret type, URL redaction
    storage     redis, store: where tandem's state lives (every service); retention (the trainer)
    engine      engine: the inference engine
    controller  controller, replica: the inference controller, this replica among others
    gateway     gateway: the OpenAI-compatible gateway
    tinker      tinker: the Tinker-compatible service
    gpus        gpus: which GPUs each side uses, shared mode's hand-over
    trainer     backend, metrics, tracker, parallel: the trainer's sections
    root        TrainerSettings, InferenceSettings, ClientSettings, TinkerSettings and SERVICES
    loading     load(): a service's settings, or one ConfigError line naming each bad variable
"""

from tandem.settings.controller import ControllerSettings, ReplicaSettings
from tandem.settings.engine import VLLM_LORA_RANKS, EngineSettings
from tandem.settings.gateway import GatewaySettings
from tandem.settings.gpus import GpuSettings, ReleaseTag
from tandem.settings.loading import load, service_arguments
from tandem.settings.root import (
    LOCAL_STACK_ENV,
    SERVICES,
    ClientSettings,
    InferenceSettings,
    TinkerSettings,
    TrainerSettings,
)
from tandem.settings.secret import Secret, redact_url
from tandem.settings.storage import RedisSettings, RetentionSettings, StoreSettings
from tandem.settings.tinker import TinkerServiceSettings
from tandem.settings.trainer import ParallelSettings, TrackerSettings, TrainerBackendSettings, TrainerMetricsSettings

__all__ = [
    "LOCAL_STACK_ENV", "SERVICES", "VLLM_LORA_RANKS", "ClientSettings", "ControllerSettings", "EngineSettings",
    "GatewaySettings", "GpuSettings", "InferenceSettings", "ParallelSettings", "RedisSettings", "ReleaseTag",
    "ReplicaSettings", "RetentionSettings", "Secret", "StoreSettings", "TinkerServiceSettings", "TinkerSettings",
    "TrackerSettings", "TrainerBackendSettings", "TrainerMetricsSettings", "TrainerSettings", "load",
    "redact_url", "service_arguments",
]
