"""The command line and environment that start SGLang for a replica (run by engines/launcher.py)."""

from __future__ import annotations

from urllib.parse import urlparse

from tandem.settings import InferenceSettings
from tandem_inference.engines.launcher import engine_env, loopback_host


def sglang_argv(settings: InferenceSettings) -> list[str]:
    """The `sglang.launch_server` command line for these settings."""
    eng = settings.engine
    url = urlparse(eng.url)
    host = loopback_host(eng.url, "SGLang", "tandem does not expose SGLang's own HTTP server (0.5.12 ran "
                         "pickled objects from an unauthenticated route, CVE-2026-15969)")
    argv = [
        eng.sglang_python, "-m", "sglang.launch_server",
        "--model-path", eng.model,
        "--served-model-name", eng.served_model_name,
        "--host", host,
        "--port", str(url.port or 30000),
        "--enable-lora",
        "--max-lora-rank", str(eng.max_lora_rank),
        "--lora-target-modules", *eng.lora_target_modules,
        "--max-loras-per-batch", str(eng.max_loras_per_batch),
        "--max-loaded-loras", str(max(eng.max_loaded_adapters, eng.max_loras_per_batch)),
        "--lora-backend", eng.lora_backend,
        "--tp-size", str(eng.tp_size),
        "--enable-metrics",
        "--enable-cache-report",
        # NOTE: dynamic LoRA loading breaks with more than one tokenizer worker (SGLang #31084, 0.5.x).
        "--tokenizer-worker-num", "1",
    ]
    if eng.admin_api_key is not None:
        argv += ["--admin-api-key", eng.admin_api_key.get_secret_value()]
    if eng.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(eng.mem_fraction_static)]
    if settings.gpus.lends_memory:  # with nothing to release, nothing to save
        argv.append("--enable-memory-saver")
        if "weights" in settings.gpus.release_tags:
            # Released weights come back as garbage unless SGLang keeps a CPU copy to restore.
            argv.append("--enable-weights-cpu-backup")
    if eng.disable_cuda_graph:
        argv.append("--disable-cuda-graph")
    elif eng.cuda_graph_max_bs is not None:
        argv += ["--cuda-graph-max-bs-decode", str(eng.cuda_graph_max_bs)]
    return argv + list(eng.extra_args)


def sglang_env(settings: InferenceSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    env = engine_env(settings, base)
    # /health as a liveness check: the default one-token generation fails while the scheduler is busy.
    env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    # tandem's logprob convention (tandem.logprobs): the temperature-scaled distribution, which is
    # SGLang's default; "true" would return the unscaled one and break every ratio at T != 1.
    env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
    # tandem's patch (images/patches/): each adapter copied into a free GPU slot at its load; the
    # setting decides, whatever the environment says
    env["SGLANG_LORA_EAGER_SLOT"] = "1" if settings.engine.eager_adapter_slot else "0"
    # and prefill CUDA graphs of 1-3 tokens beside SGLang's own sizes
    env["SGLANG_PREFILL_GRAPHS_FROM_ONE"] = "1" if settings.engine.prefill_graphs_from_one_token else "0"
    return env
