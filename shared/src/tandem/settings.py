"""Settings of every tandem service, one pydantic-settings class per service.

Environment variables use the prefix `TANDEM_` and `__` for nesting, for example
`TANDEM_REDIS__URL` or `TANDEM_ENGINE__MAX_LORA_RANK`. A shared `.env` file is read too;
keys that belong to another service are ignored, not fatal. Each service prints its
resolved settings, secrets redacted, with `tandem settings <service>`.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import redis
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.errors import BackendUnavailable, ConfigError
from tandem.runs import DEFAULT_TARGETS


def _unset_if_empty(value: object) -> object:
    return None if isinstance(value, str) and not value.strip() else value


Secret = Annotated[SecretStr | None, BeforeValidator(_unset_if_empty)]
"""An optional secret (a key, a password). Empty or blank is unset, as compose's `${VAR:-}` passes
an unset variable: never a key that an empty `Authorization: Bearer ` header would match."""


def redact_url(url: str) -> str:
    """The URL with its password, if any, shown as '***' (for logs and messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


class RedisSettings(BaseModel):
    """Where Redis is."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL (`redis://[:password@]host:port/db`)."""
    password: Secret = None
    """Password, if not in the URL."""
    socket_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Timeout of one Redis command, in seconds (blocking reads add their own block time)."""

    def connect(self, *, ping: bool = True, timeout_s: float | None = None) -> redis.Redis:
        """Open a client; raises BackendUnavailable naming the URL when Redis does not answer, and
        ConfigError naming it when it is not a Redis URL or Redis refuses its credentials (both
        found by a PING; `ping=False` leaves it out, for a client whose every use copes with failure).
        `timeout_s` bounds its commands below socket_timeout_s (a scrape, a request's read)."""
        timeout = self.socket_timeout_s if timeout_s is None else min(self.socket_timeout_s, timeout_s)
        try:
            client = redis.Redis.from_url(
                self.url,
                password=self.password.get_secret_value() if self.password else None,
                socket_timeout=timeout,
                socket_connect_timeout=min(timeout, 10.0),
            )
        except ValueError as exc:  # redis-py's answer to a URL it cannot read
            raise ConfigError(
                f"Redis URL {redact_url(self.url)!r} cannot work ({exc}); set TANDEM_REDIS__URL to "
                "redis://[:password@]host:port/db (rediss:// for TLS, unix:///path.sock?db=0)"
            ) from exc
        if not ping:
            return client
        try:
            client.ping()
        except redis.AuthenticationError as exc:  # it answered: the password is what is wrong
            raise ConfigError(
                f"Redis at {redact_url(self.url)!r} answers but refuses these credentials ({exc}); make the "
                "password in TANDEM_REDIS__URL (redis://:PASSWORD@host:port/db) or TANDEM_REDIS__PASSWORD that "
                "Redis's own, or none where it has none"
            ) from exc
        except redis.RedisError as exc:
            raise BackendUnavailable(
                f"Redis at {redact_url(self.url)!r} does not answer ({exc}); start it or set TANDEM_REDIS__URL"
            ) from exc
        return client


class StoreSettings(BaseModel):
    """The adapter volume."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    root: Path = Path(".tandem/adapters")
    """Directory that holds every adapter version; shared by trainer (rw) and inference (ro)."""


#: The LoRA ranks vLLM can be started with (its `--max-lora-rank` choices, 0.33).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class EngineSettings(BaseModel):
    """The inference engine (SGLang or vLLM on GPUs, or the transformers engine on CPU)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    kind: Literal["transformers", "sglang", "vllm"] = "transformers"
    """Which engine serves rollouts: `sglang` or `vllm` (each in its own image, started and supervised
    by the inference service), or `transformers` (tandem's own, for the CPU stack)."""
    url: str = "http://127.0.0.1:30000"
    """Base URL of the engine's HTTP API (private: never publish it)."""
    launch: bool = False
    """With kind=transformers: the inference service starts the engine as its own supervised child,
    listening on host:port (one engine per replica), instead of reaching one at `url`. SGLang and vLLM
    are always started by the service."""
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
    """Largest LoRA rank the engine accepts; larger adapters are rejected. vLLM takes only 1, 8, 16,
    32, 64, 128, 256, 320 or 512."""
    max_loaded_adapters: int = Field(8, ge=1, le=256)
    """How many adapters the engine holds at once (vLLM: `--max-cpu-loras`)."""
    admin_api_key: Secret = None
    """Key that guards load/unload and memory routes of the engine. Unset: the transformers engine
    answers those routes on loopback only. Every stack sets one (`tandem up` generates it). vLLM
    has no admin key of its own: there it is vLLM's API key (`VLLM_API_KEY`), which guards its
    `/v1` routes, generation included; its sleep and RPC routes stay unguarded, so vLLM listens on
    loopback only."""
    load_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Timeout of one adapter load, in seconds."""
    unload_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Timeout of one adapter unload, in seconds."""
    generate_timeout_s: float = Field(300.0, gt=0, le=86400)
    """Timeout of one generation request, in seconds."""
    max_new_tokens_limit: int = Field(4096, ge=1)
    """Largest `max_tokens` a request may ask for."""
    sglang_python: str = "python3"
    """Interpreter of SGLang's own environment (SGLang and tandem never share one)."""
    vllm_python: str = "python3"
    """Interpreter of vLLM's own environment (vLLM, SGLang and tandem never share one)."""
    lora_target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Modules SGLang prepares LoRA buffers for; adapters may target a subset."""
    max_loras_per_batch: int = Field(8, ge=1, le=256)
    """Adapters SGLang mixes in one batch (the base model takes a slot); vLLM's `--max-loras`."""
    tp_size: int = Field(1, ge=1, le=64)
    """Tensor-parallel size of SGLang (or vLLM)."""
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    """Share of GPU memory SGLang reserves for weights and KV cache (vLLM: `--gpu-memory-utilization`);
    unset = the engine's default."""
    cuda_graph_max_bs: int | None = Field(None, ge=1)
    """Largest batch size SGLang captures CUDA graphs for (vLLM: `--max-cudagraph-capture-size`);
    small values shorten boot."""
    disable_cuda_graph: bool = False
    """Skip CUDA-graph capture (faster boot, slower decode; vLLM: `--enforce-eager`)."""
    lora_backend: Literal["triton", "csgmv"] = "triton"
    """SGLang's LoRA kernels (`--lora-backend`). NOTE: 0.5.12's default, csgmv, decodes wrong tokens
    for every adapter but one in a mixed batch under CUDA graphs (its kernel grid is sized at graph
    capture, sglang#28371, fixed in later releases); triton decodes each request of a mixed batch
    as it decodes alone (docs/benchmarks.md, "Mixed-adapter batches")."""
    extra_args: list[str] = Field(default_factory=list)
    """More flags of the engine's command line (`sglang.launch_server`, `vllm serve`), passed as they are."""
    boot_timeout_s: float = Field(900.0, gt=0)
    """How long the launcher waits for the engine (SGLang, vLLM) to become healthy, in seconds."""
    max_restarts: int = Field(5, ge=0)
    """Restarts of a crashed engine within `restart_window_s` before the launcher gives up."""
    restart_window_s: float = Field(600.0, gt=0)
    """Window over which restarts are counted, in seconds."""
    adapter_roots: list[Path] | None = None
    """Directories the transformers engine loads adapters from (a JSON list: `["/adapters"]`);
    `/load_lora_adapter` refuses a path outside them, symlinks resolved (400). Unset: the adapter
    store (`store.root`)."""
    weights_roots: list[Path] | None = None
    """Directories the transformers engine reads `/update_weights_from_disk` checkpoints from (a
    JSON list); it refuses a path outside them, symlinks resolved (400). Unset: the directory that holds the base
    model (`engine.model`, when it is a local path; none for a hub id)."""

    @model_validator(mode="after")
    def _no_colon(self) -> EngineSettings:
        if ":" in self.served_model_name:
            raise ValueError(
                f"engine.served_model_name {self.served_model_name!r} contains ':'; "
                "SGLang splits OpenAI model names at ':'"
            )
        return self

    @model_validator(mode="after")
    def _vllm_rank(self) -> EngineSettings:
        if self.kind == "vllm" and self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(
                f"engine.max_lora_rank={self.max_lora_rank} with engine.kind=vllm: vLLM's --max-lora-rank takes "
                f"only {', '.join(map(str, VLLM_LORA_RANKS))}; pick the smallest of them at or above your adapters' rank"
            )
        return self


class ControllerSettings(BaseModel):
    """The inference controller that follows the event stream and loads adapters."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    consumer: str = "inference"
    """Name of the controller's cursor on the event stream; each replica keeps its own, `<consumer>:<replica.id>`."""
    keep_versions: int = Field(2, ge=1, le=64)
    """How many newest versions per run stay loaded (older ones are unloaded when idle)."""
    block_ms: int = Field(1000, ge=1, le=60000)
    """How long one blocking read of the event stream waits, in milliseconds."""
    reconcile_s: float = Field(5.0, gt=0, le=3600)
    """How often the controller reconciles with the registry and the engine, in seconds: it loads
    a registered version that was never announced, loads again what the engine lost and unloads
    adapters the engine holds that nothing routes to."""


def _host_id() -> str:
    """The host name as a replica id: its first 63 characters of letters, digits, `.`, `_`, `-`."""
    name = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "-" for c in socket.gethostname())
    return name.lstrip("._-")[:63] or "replica"


class ReplicaSettings(BaseModel):
    """This inference service as one replica among others sharing the Redis (tandem.replicas)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    id: str = Field(default_factory=lambda: _host_id(), pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                    json_schema_extra={"shown_default": "the host name"})
    """The replica's name in Redis, events (`adapter_loaded`) and responses (`x-tandem-replica`);
    by default the host name (a container's or pod's name). Unique per replica."""
    url: str | None = None
    """Where this replica's gateway answers for a router; unset: http://<host name>:<gateway.port>."""
    heartbeat_s: float = Field(2.0, gt=0, le=60)
    """How often the replica writes its heartbeat (state and versions held), in seconds."""
    ttl_s: float = Field(10.0, gt=0, le=600)
    """How long a heartbeat lasts: a replica silent this long is gone, in seconds."""
    agree_s: float = Field(10.0, gt=0, le=3600)
    """Longest a replica holding a new version waits for the other ready replicas to hold it before it
    serves it anyway, in seconds; a replica still without it then leaves rotation until it catches up."""


class GatewaySettings(BaseModel):
    """The OpenAI-compatible gateway."""

    model_config = ConfigDict(use_attribute_docstrings=True)

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
    published_host: str | None = None
    """Host address the gateway's port is published on when it runs in a container (compose sets it
    from GATEWAY_BIND); the check for serving beyond loopback without `api_key` reads it instead of
    `host`."""
    allow_unauthenticated: bool = False
    """Serve without `api_key` on an address beyond loopback. Off: the inference service refuses to
    start that way."""
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


#: What the engine can free for the trainer in shared mode.
ReleaseTag = Literal["kv_cache", "weights", "cuda_graph"]


def _default_release_tags() -> list[ReleaseTag]:
    return ["kv_cache"]


class GpuSettings(BaseModel):
    """Which GPUs each side uses; read by both services from the same `.env`."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    mode: Literal["split", "shared", "cpu"] = "cpu"
    """split: disjoint GPUs for inference and training; shared: both on one GPU with a lease; cpu: no GPU."""
    inference: list[int] = Field(default_factory=lambda: [0])
    """GPU indices of the inference engine (split and shared mode)."""
    trainer: list[int] = Field(default_factory=lambda: [1])
    """GPU indices of the trainer (split mode; shared mode uses the inference GPU)."""
    lease_ttl_s: float = Field(60.0, gt=0, le=3600)
    """Shared mode: a GPU lease expires this long after its holder's last renewal, in seconds."""
    lease_wait_s: float = Field(600.0, gt=0)
    """Shared mode: how long the trainer waits for inference to hand the GPU over, in seconds."""
    release_tags: list[ReleaseTag] = Field(default_factory=_default_release_tags)
    """Shared mode: what the engine frees for the trainer. The KV cache is nearly all of it; adding
    `weights` makes SGLang keep a CPU copy of the base weights (--enable-weights-cpu-backup). None
    (`[]`): the engine keeps all of its memory and only stops serving while the trainer steps, for
    a trainer that fits beside it; each hand-over then skips the release and the resume (vLLM's
    wake-up took 0.43 s of every policy sync in shared mode)."""

    @model_validator(mode="after")
    def _disjoint(self) -> GpuSettings:
        if self.mode == "split":
            both = sorted(set(self.inference) & set(self.trainer))
            if both:
                raise ValueError(
                    f"split mode needs disjoint GPUs, but gpus.inference={self.inference} and "
                    f"gpus.trainer={self.trainer} share {both}; pick other GPUs or use mode 'shared'"
                )
            if not self.inference or not self.trainer:
                raise ValueError("split mode needs gpus.inference and gpus.trainer to name at least one GPU each")
        return self


class TrainerBackendSettings(BaseModel):
    """How the trainer runs the model."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    kind: Literal["auto", "peft", "unsloth"] = "auto"
    """`auto` picks Unsloth when it imports and CUDA is there, else peft."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one micro-batch (padded tokens); larger batches accumulate gradients."""
    gradient_checkpointing: bool = True
    """Recompute activations in backward on CUDA (less memory, ~30% more compute); ignored on CPU."""
    step_breakdown: bool = False
    """Time each stage of a training step (the order to the other ranks, packing, forward and
    backward of each micro-batch, the ranks' settle, the gradient all-reduce, the optimizer, staging
    the adapter) with a device synchronise around each, into each version's metrics as
    `stage_<name>_s`. The synchronises cost time of their own: for measuring, not for training."""
    adapter_dtype: Literal["float32", "auto", "bfloat16", "float16"] = "auto"
    """Dtype of the published adapter weights, the bytes on the path to serving. `auto` is the
    trainer's compute dtype: bfloat16 on GPUs that have it (engines serve in it anyway), float32
    on the CPU. A narrower adapter halves the bytes to copy, write, check and load; the float32
    master weights then go into the version's trainer state, so resuming loses no precision."""


class TrainerMetricsSettings(BaseModel):
    """The trainer's Prometheus endpoint (`GET /metrics`), served by the process that runs the jobs."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    enabled: bool = True
    """Serve `/metrics`; off: the trainer listens on no port at all."""
    host: str = "127.0.0.1"
    """Address `/metrics` binds to: loopback by default; the container stacks set `0.0.0.0`, their
    private network, and never publish the port."""
    port: int = Field(9310, ge=1, le=65535)
    """Port of `/metrics`."""


class TrackerSettings(BaseModel):
    """Where the trainer logs each run's learning curve, one tracker run per tandem run."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    kind: Literal["none", "mlflow", "wandb"] = "none"
    """`mlflow` (needs `tandem-trainer[mlflow]`), `wandb` (needs `tandem-trainer[wandb]`) or `none`."""
    experiment: str = Field("tandem", min_length=1, max_length=128)
    """MLflow experiment, or Weights & Biases project, that the runs go into."""
    mlflow_uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI: a tracking server (`http://127.0.0.1:5000`; what `tandem-trainer[mlflow]`
    talks to), or, with the full `mlflow` package installed, a database (`sqlite:///mlflow.db`,
    relative to the trainer's working directory) or a file store (`file:./mlruns`)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """Weights & Biases mode: `offline` writes the runs under `wandb_dir` only (`wandb sync` uploads
    them later); `online` sends them (needs `WANDB_API_KEY`)."""
    wandb_dir: Path = Path(".")
    """Directory Weights & Biases writes its `wandb/` folder of runs into."""


class ParallelSettings(BaseModel):
    """Data-parallel training: several trainer processes (ranks) train each job together."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    ranks: int | None = Field(None, ge=1, le=64)
    """Trainer processes on this machine, started by torchrun. Unset: one per GPU of `gpus.trainer`
    in split mode, else 1. Rank 0 takes jobs from the queue and publishes; every rank trains a
    share of each job's micro-batches and the gradients are summed across ranks before the
    optimizer step (NCCL on GPUs, gloo on the CPU). Every rank needs the model in its own memory."""
    max_restarts: int = Field(100, ge=0, le=100000)
    """How often torchrun starts the ranks again after one of them failed (a job in flight fails
    with a message naming the rank); past it the trainer exits and its container's restart policy
    takes over."""
    nodes: int = Field(1, ge=1, le=256)
    """Machines (containers, pods) whose ranks train as one group: each runs `tandem-trainer` with
    the same settings and `ranks` ranks, so the group has `nodes x ranks` ranks. Above 1 the nodes
    meet at `rendezvous_endpoint` (torchrun's c10d rendezvous) instead of on loopback."""
    rendezvous_endpoint: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9.\-]*:[0-9]{1,5}$")
    """`host:port` where the nodes meet (torchrun `--rdzv-endpoint`): the node whose host name or
    address this is hosts the rendezvous store on that port, the others connect to it. Required
    when `nodes` is above 1; unset, the ranks of one machine meet on loopback (`--standalone`)."""
    rendezvous_id: str = Field("tandem-trainer", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
    """Name of the group at the rendezvous (torchrun `--rdzv-id`): the same on every node of one
    trainer, another for a second trainer that meets at the same endpoint."""
    node_address: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9.\-:]*$")
    """Host name or address by which the other nodes reach this one (torchrun `--local-addr`);
    unset: this machine's fully qualified host name, which must resolve on the other nodes."""
    rendezvous_timeout_s: int = Field(900, ge=10, le=86400)
    """How long a node waits at the rendezvous for the others, in seconds, at start and after a
    restart; past it the node's trainer exits."""

    def world(self, gpus: GpuSettings) -> int:
        """How many ranks train on this machine: `ranks`, or one per trainer GPU in split mode."""
        if self.ranks is not None:
            return self.ranks
        return len(gpus.trainer) if gpus.mode == "split" else 1

    def total(self, gpus: GpuSettings) -> int:
        """How many ranks the group has, on every node together."""
        return self.world(gpus) * self.nodes

    @model_validator(mode="after")
    def _nodes_meet_somewhere(self) -> ParallelSettings:
        if self.nodes > 1 and self.rendezvous_endpoint is None:
            raise ValueError(
                f"parallel.nodes={self.nodes} but parallel.rendezvous_endpoint is unset; the nodes "
                "need a host:port to meet at (TANDEM_PARALLEL__RENDEZVOUS_ENDPOINT, e.g. trainer-0:29400)"
            )
        return self


#: Where `tandem up` (run from this directory) writes the gateway and Redis URLs of its stack.
LOCAL_STACK_ENV = ".tandem/stack/client.env"

_CONFIG = SettingsConfigDict(
    env_prefix="TANDEM_", env_nested_delimiter="__", env_file=".env", extra="ignore",
    use_attribute_docstrings=True,
)


class _ServiceSettings(BaseSettings):
    model_config = _CONFIG

    redis: RedisSettings = RedisSettings()
    store: StoreSettings = StoreSettings()

    def redacted(self) -> dict[str, Any]:
        """The resolved settings as JSON-able data, secrets shown as '**********'."""
        data: dict[str, Any] = json.loads(self.model_dump_json())
        data["redis"]["url"] = redact_url(self.redis.url)
        return data


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
    parallel: ParallelSettings = ParallelSettings()
    metrics: TrainerMetricsSettings = TrainerMetricsSettings()
    tracker: TrackerSettings = TrackerSettings()

    def redacted(self) -> dict[str, Any]:
        data = super().redacted()
        data["tracker"]["mlflow_uri"] = redact_url(self.tracker.mlflow_uri)
        return data

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
    silent_replica_s: float = Field(15.0, gt=0, le=3600)
    """Once a replica serves the new version, how long `train()` still waits for a ready replica
    that said nothing of it (neither held, served nor refused it), in seconds; then it is not
    waited for (a replica that agrees leaves it behind after `replica.agree_s`, 10 s)."""


SERVICES: dict[str, type[_ServiceSettings]] = {
    "trainer": TrainerSettings,
    "inference": InferenceSettings,
    "client": ClientSettings,
}

