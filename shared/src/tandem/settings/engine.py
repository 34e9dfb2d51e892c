"""The inference engine's section (`TANDEM_ENGINE__*`): which engine, how it is launched, its
limits and timeouts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from tandem.runs import DEFAULT_TARGETS
from tandem.settings.secret import Secret
from tandem.settings.section import SECTION

#: The LoRA ranks vLLM can be started with (its `--max-lora-rank` choices, 0.33).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class EngineSettings(BaseModel):
    """The inference engine (SGLang or vLLM on GPUs, or the transformers engine on CPU)."""

    model_config = SECTION

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
    """How many adapters the engine holds at once: its slots. More versions than slots are served by
    loading on demand and evicting the least recently used adapter no request holds (SGLang:
    `--max-loaded-loras`, vLLM: `--max-cpu-loras`, each at least `max_loras_per_batch`)."""
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
    kv_cache_gib: float | None = Field(None, gt=0, le=65536)
    """vLLM: the KV cache's size in GiB (`--kv-cache-memory-bytes`), instead of all that
    `mem_fraction_static` leaves after the weights. Unset: 8 GiB in shared mode with something to
    release (`gpus.release_tags`), vLLM's own sizing otherwise. Each shared-mode hand-over maps the
    whole cache again: vLLM's wake-up took 411 ms p50 for the ~80 GiB that 0.6 of an H200 leaves a
    0.5B model, 9 ms for 8 GiB (docs/benchmarks.md). A token costs 2 x layers x KV heads x head dim
    x 2 bytes: 8 GiB holds ~700k tokens of Qwen2.5-0.5B, ~65k of an 8B of 32 layers and 8 KV heads;
    vLLM's log gives the count at start-up ("GPU KV cache size"). Ignored by SGLang, whose
    resume takes 10-18 ms at any size."""
    eager_adapter_slot: bool = True
    """SGLang: copy each adapter into a free slot of the GPU memory pool when it loads
    (`SGLANG_LORA_EAGER_SLOT=1`), instead of in the first batch that uses it, which is on the path
    of a new version's first response. Measured on 2 x H200 at 0.5B (split, SGLang's own kernels,
    2026-11-30): that response came 76.6 ms p50 after the load instead of 104.8, the load took 78.1
    instead of 72.1, optimizer step -> first response 201.5 instead of 222.5; mixed batches and
    trainer agreement passed with it (docs/benchmarks.md). Only a free slot is taken; with none free
    the copy stays in the first batch. It needs tandem's patch to SGLang (images/patches/), which
    the inference image applies; an unpatched SGLang ignores the variable. Ignored by vLLM, whose
    load does that copy itself."""
    prefill_graphs_from_one_token: bool = True
    """SGLang: capture prefill CUDA graphs of 1, 2 and 3 tokens besides SGLang's own sizes, which
    start at 4 (`SGLANG_PREFILL_GRAPHS_FROM_ONE=1`, tandem's patch, images/patches/). SGLang replays
    a prefill's graph only where padding at most doubles it, so without these a prefill of one
    token -- a prompt cached but for its last token, or a one-token prompt -- runs every layer
    eagerly. Measured on 2 x H200 with SGLang's own kernels (2026-11-30, docs/benchmarks.md): such
    a prefill took 20.9 ms p50 at 0.5B instead of 46.7, and a new version's first forward in the
    sync path 29.6 ms instead of 76.6 (0.5B split, two leases of the machine kind); with
    `eager_adapter_slot` too, against the unpatched engine, optimizer step -> first response took
    175.1 ms instead of 227.4 at 8B (split). Mixed batches and trainer agreement passed with it. An
    unpatched SGLang ignores the variable; so do vLLM and `disable_cuda_graph`."""
    batch_invariant: bool = False
    """vLLM: its batch-invariant mode (`VLLM_BATCH_INVARIANT=1`), for rollouts that decode the same
    whatever else is in the batch. With tandem's flags vLLM's batched greedy outputs left their solo
    outputs at near-ties in 78 of 140 requests, none of 140 in this mode (one H200, 2026-11-29).
    It cost 0.73-0.91 x the tokens/s at one client, and stayed within run-to-run spread at 8 and
    64 (2026-11-30). Ignored by SGLang, whose batched outputs matched the solo ones (0 of 140)
    without it."""
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
