"""The command line and environment that start vLLM for a replica (run by engines/launcher.py).

Flags and variables as vLLM 0.33.0 reads them (vllm/engine/arg_utils.py, vllm/envs.py):

- `--logprobs-mode processed_logprobs`: tandem's convention (tandem.logprobs) is the
  temperature-scaled distribution; vLLM's default, `raw_logprobs`, is the model's before
  temperature. NOTE: vLLM's processed logprobs are taken after top-k/top-p too, so with
  `top_p < 1` a token's logprob is under the renormalised nucleus: higher than tandem's by the
  log of the nucleus' mass (0 for top_p 1, tandem's default). The mode also turns FlashInfer's
  sampling kernels off (vLLM samples in PyTorch then).
- `--generation-config vllm`: the model's generation_config.json (Qwen's sets top_k 20 and a
  repetition penalty of 1.05) would otherwise fill every sampling field a request leaves out,
  and the logprobs would no longer be the model's.
- runtime LoRA: `--enable-lora`, `--max-loras` (adapters in one batch), `--max-cpu-loras` (held),
  `--max-lora-rank` and VLLM_ALLOW_RUNTIME_LORA_UPDATING; one API server (`--api-server-count
  1`: a load reaches only the server process that answered it).
- VLLM_SERVER_DEV_MODE=1 for the sleep, pause, prefix-cache and RPC routes; in shared mode with
  something to release (`gpus.release_tags` not empty) `--enable-sleep-mode` (weights copied to
  the CPU and back, vLLM's counterpart of SGLang's memory saver) and a KV cache of
  `engine.kv_cache_gib` (8 GiB unless set): each wake-up maps the whole cache again, which took
  411 ms p50 for the ~80 GiB vLLM would otherwise take on an H200, 9 ms for 8 GiB.
- `engine.batch_invariant`: VLLM_BATCH_INVARIANT=1, vLLM's batch-invariant kernels (a batched
  greedy request decodes as it does alone; off by default).
- the key: vLLM's only key, VLLM_API_KEY (never on the command line, which `ps` shows), is
  `engine.admin_api_key`; it guards `/v1` (generation, adapters), not the dev routes, so vLLM
  must listen on loopback: a non-loopback `engine.url` is refused.
"""

from __future__ import annotations

from urllib.parse import urlparse

from tandem.settings import InferenceSettings
from tandem_inference.engines.launcher import engine_env, loopback_host

#: What vLLM's logprobs are: tandem's convention, the temperature-scaled distribution.
LOGPROBS_MODE = "processed_logprobs"
#: The KV cache in shared mode unless `engine.kv_cache_gib` says otherwise: each hand-over's
#: wake-up maps it again (9 ms p50 for 8 GiB against 411 ms for ~80 GiB, one H200, 2026-11-29).
SHARED_KV_CACHE_GIB = 8.0


def vllm_argv(settings: InferenceSettings) -> list[str]:
    """The `vllm serve` command line for these settings."""
    eng = settings.engine
    url = urlparse(eng.url)
    host = loopback_host(eng.url, "vLLM", "vLLM's sleep, pause and RPC routes have no key")
    argv = [
        eng.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", eng.model,
        "--served-model-name", eng.served_model_name,
        "--host", host,
        "--port", str(url.port or 30000),
        "--api-server-count", "1",
        "--generation-config", "vllm",
        "--logprobs-mode", LOGPROBS_MODE,
        "--enable-prompt-tokens-details",
        "--enable-lora",
        "--max-lora-rank", str(eng.max_lora_rank),
        "--max-loras", str(eng.max_loras_per_batch),
        "--max-cpu-loras", str(max(eng.max_loaded_adapters, eng.max_loras_per_batch)),
        "--tensor-parallel-size", str(eng.tp_size),
    ]
    if eng.mem_fraction_static is not None:
        argv += ["--gpu-memory-utilization", str(eng.mem_fraction_static)]
    if settings.gpus.lends_memory:
        argv.append("--enable-sleep-mode")
    kv_gib = eng.kv_cache_gib if eng.kv_cache_gib is not None else (
        SHARED_KV_CACHE_GIB if settings.gpus.lends_memory else None)
    own_kv = any(a == "--kv-cache-memory-bytes" or a.startswith("--kv-cache-memory-bytes=") for a in eng.extra_args)
    if kv_gib is not None and not own_kv:
        argv += ["--kv-cache-memory-bytes", str(int(kv_gib * 2**30))]
    if eng.disable_cuda_graph:
        argv.append("--enforce-eager")
    elif eng.cuda_graph_max_bs is not None:
        argv += ["--max-cudagraph-capture-size", str(eng.cuda_graph_max_bs)]
    return argv + list(eng.extra_args)


def vllm_env(settings: InferenceSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM's environment: this one's, plus the variables that switch on what tandem uses."""
    env = engine_env(settings, base)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["VLLM_SERVER_DEV_MODE"] = "1"
    # vLLM reports usage to its maintainers unless told not to; tandem's engines stay private.
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["VLLM_DO_NOT_TRACK"] = "1"
    if settings.engine.batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    if settings.engine.admin_api_key is not None:
        env["VLLM_API_KEY"] = settings.engine.admin_api_key.get_secret_value()
    else:
        env.pop("VLLM_API_KEY", None)
    return env
