"""Record a real engine's HTTP exchanges for tandem's engine-client tests.

Starts the engine with tandem's launcher (tiny model, LoRA on the attention projections only),
then makes every call tandem's engine client makes, good and bad, and writes each exchange
(method, path, request body, status, response body) to OUT/<engine>_recorded.json. The unit
tests replay them through httpx.MockTransport, so the client is tested against what the
real server answered, not against what its documentation says. vLLM's generation bodies are
the ones its client builds (`VLLMEngine._completion_body`).

    python bench/gpu/record_engine.py --sglang-python /tmp/sgpython --out $OUT
    python bench/gpu/record_engine.py --engine vllm --vllm-python /tmp/vlpython --out $OUT
    python bench/gpu/record_engine.py --engine transformers --out /tmp/rec    # dry run on CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from tandem.settings import EngineSettings, GpuSettings, InferenceSettings
from tandem_inference.engines.base import Sampling
from tandem_inference.engines.launcher import Launcher
from tandem_inference.engines.sglang_launcher import sglang_argv, sglang_env
from tandem_inference.engines.vllm import VLLMEngine
from tandem_inference.engines.vllm_launcher import vllm_argv, vllm_env

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
#: The longest body kept of a text reply (vLLM's /metrics runs to hundreds of kB).
TEXT_LIMIT = 20000
Call = Callable[..., Awaitable[None]]


async def record(args: argparse.Namespace) -> list[dict]:
    from tandem_trainer.tiny_model import build_random_adapter, build_tiny_model

    out = Path(args.out)
    model = build_tiny_model(out / "model")
    adapters = out / "adapters"
    files = {
        "good": build_random_adapter(model, adapters / "good", rank=8, scale=0.05, target_modules=["q_proj", "v_proj"]),
        "big": build_random_adapter(model, adapters / "rank32", rank=32, scale=0.05, target_modules=["q_proj", "v_proj"]),
        "mlp": build_random_adapter(model, adapters / "mlp", rank=8, scale=0.05, target_modules=["gate_proj"]),
        "missing": out / "adapters" / "nope", "model": model,
    }
    port = 30000  # SGLang derives more ports above its own; keep it low
    settings = InferenceSettings(
        # shared mode: vLLM starts with --enable-sleep-mode, so its sleep and wake routes answer
        gpus=GpuSettings(mode={"vllm": "shared", "sglang": "split"}.get(args.engine, "cpu")),
        engine=EngineSettings(
            kind=args.engine, url=f"http://127.0.0.1:{port}", model=str(model), sglang_python=args.sglang_python,
            vllm_python=args.vllm_python, max_lora_rank=16, lora_target_modules=ATTENTION, cuda_graph_max_bs=4,
            mem_fraction_static=0.5, adapter_roots=[adapters],
            extra_args=(["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
                        if args.engine == "sglang" else []),
        ))
    exchanges: list[dict] = []
    async with httpx.AsyncClient(base_url=settings.engine.url, timeout=120) as http:
        if args.engine == "sglang":
            launcher = Launcher(settings, http, argv=sglang_argv(settings), env=sglang_env(settings),
                                log_path=out / "sglang.log")
        elif args.engine == "vllm":
            launcher = Launcher(settings, http, argv=vllm_argv(settings), env=vllm_env(settings),
                                log_path=out / "vllm.log")
        else:
            env = {**os.environ, "TANDEM_ENGINE__PORT": str(port), "TANDEM_ENGINE__MODEL": str(model),
                   "TANDEM_ENGINE__MAX_LORA_RANK": "16", "TANDEM_ENGINE__LORA_TARGET_MODULES": json.dumps(ATTENTION),
                   "TANDEM_ENGINE__ADAPTER_ROOTS": json.dumps([str(adapters)])}
            launcher = Launcher(settings, http, argv=[sys.executable, "-m", "tandem_inference.engines.transformers"],
                                env=env, log_path=out / "engine.log")
        boot_s = await launcher.start()
        try:
            async def call(name: str, method: str, path: str, body: dict | None = None) -> None:
                record = {"name": name, "method": method, "path": path, "request": body}
                try:
                    resp = await http.request(method, path, json=body, timeout=args.call_timeout_s)
                except httpx.TimeoutException:
                    # NOTE: seen with SGLang 0.5.12: an unload after failed loads, 400s and a
                    # stream on the adapter never returned (the use-count leak, #34205).
                    record.update(status="timeout", response=None)
                else:
                    try:
                        payload = resp.json()
                    except ValueError:
                        payload = resp.text[:TEXT_LIMIT]
                    record.update(status=resp.status_code, content_type=resp.headers.get("content-type"),
                                  response=payload)
                exchanges.append(record)
                (out / f"{args.engine}_recorded.json").write_text(json.dumps(exchanges, indent=1))  # kept if we crash
                print(f"{name}: {record['status']}", flush=True)

            await (vllm_calls if args.engine == "vllm" else sglang_calls)(call, files)
        finally:
            launcher.stop()
    exchanges.append({"name": "boot", "boot_s": boot_s, "engine": args.engine})
    return exchanges


async def loads(call: Call, files: dict[str, Path], route: str) -> None:
    """The adapter listing around loads good and bad (a duplicate name, a rank above the engine's,
    a module it serves no LoRA on, a path that does not exist), at the engine's load `route`."""
    await call("models_empty", "GET", "/v1/models")
    for name, adapter, path in (("load_ok", "rec-v1", files["good"]), ("load_duplicate", "rec-v1", files["good"]),
                                ("load_rank_too_big", "rec-big", files["big"]), ("load_bad_target", "rec-mlp", files["mlp"]),
                                ("load_missing_path", "rec-missing", files["missing"])):
        await call(name, "POST", route, {"lora_name": adapter, "lora_path": str(path)})
    await call("models_loaded", "GET", "/v1/models")


async def sglang_calls(call: Call, files: dict[str, Path]) -> None:
    """SGLang's native API, as SGLangEngine calls it (also what the transformers engine serves)."""
    prompt = [1, 18, 19, 20, 21]
    sampling = {"max_new_tokens": 6, "temperature": 1.0}
    await call("health", "GET", "/health")
    await call("server_info", "GET", "/server_info")
    await loads(call, files, "/load_lora_adapter")
    await call("generate_lora", "POST", "/generate", {"input_ids": prompt, "sampling_params": sampling,
               "lora_path": "rec-v1", "return_logprob": True, "logprob_start_len": -1})
    await call("generate_base", "POST", "/generate", {"input_ids": prompt, "sampling_params": sampling,
               "return_logprob": True, "logprob_start_len": -1})
    await call("generate_unknown_adapter", "POST", "/generate", {"input_ids": prompt,
               "sampling_params": sampling, "lora_path": "never-loaded", "return_logprob": True})
    await call("generate_stream", "POST", "/generate", {"input_ids": prompt, "sampling_params": sampling,
               "lora_path": "rec-v1", "return_logprob": True, "logprob_start_len": -1, "stream": True})
    await call("chat_lora", "POST", "/v1/chat/completions", {"model": "base:rec-v1", "max_tokens": 6,
               "messages": [{"role": "user", "content": "Count."}]})
    await call("chat_unknown_adapter", "POST", "/v1/chat/completions", {"model": "base:never-loaded",
               "max_tokens": 6, "messages": [{"role": "user", "content": "Count."}]})
    await call("generate_prefix_1", "POST", "/generate", {"input_ids": prompt * 20,
               "sampling_params": {"max_new_tokens": 2}, "lora_path": "rec-v1"})
    await call("generate_prefix_2", "POST", "/generate", {"input_ids": prompt * 20,
               "sampling_params": {"max_new_tokens": 2}, "lora_path": "rec-v1"})
    await call("metrics", "GET", "/metrics")  # what the gateway's /metrics/engine relays
    await call("flush_cache", "POST", "/flush_cache")
    await call("unload_ok", "POST", "/unload_lora_adapter", {"lora_name": "rec-v1"})
    await call("unload_unknown", "POST", "/unload_lora_adapter", {"lora_name": "never-loaded"})
    await call("release_memory", "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
    await call("resume_memory", "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})


async def vllm_calls(call: Call, files: dict[str, Path]) -> None:
    """vLLM's OpenAI and dev routes, as VLLMEngine calls them, in the order the controller would."""
    prompt = [1, 18, 19, 20, 21]
    client = VLLMEngine(httpx.AsyncClient(), "http://unused", served_model_name="base")  # builds bodies only
    await client.http.aclose()

    def completion(adapter: str | None, n: int = 1, prompt_ids: list[int] = prompt, max_tokens: int = 6) -> dict:
        return client._completion_body(prompt_ids, Sampling(max_tokens=max_tokens, temperature=1.0), n, adapter, True)

    async def generates(name: str) -> None:  # a request after a memory call: does vLLM schedule again?
        await call(name, "POST", "/v1/completions", completion("rec-v2"))

    await call("health", "GET", "/health")
    await loads(call, files, "/v1/load_lora_adapter")
    await call("complete_lora", "POST", "/v1/completions", completion("rec-v1"))
    await call("complete_n3", "POST", "/v1/completions", completion("rec-v1", n=3))
    await call("complete_base", "POST", "/v1/completions", completion(None))
    await call("complete_unknown_adapter", "POST", "/v1/completions", completion("never-loaded"))
    await call("complete_stream", "POST", "/v1/completions",
               {**completion("rec-v1", n=2), "stream": True, "stream_options": {"include_usage": True}})
    await call("chat_lora", "POST", "/v1/chat/completions", {"model": "rec-v1", "max_tokens": 6,
               "messages": [{"role": "user", "content": "Count."}]})
    await call("complete_prefix_1", "POST", "/v1/completions", completion("rec-v1", prompt_ids=prompt * 40, max_tokens=2))
    await call("complete_prefix_2", "POST", "/v1/completions", completion("rec-v1", prompt_ids=prompt * 40, max_tokens=2))
    await call("flush_cache", "POST", "/reset_prefix_cache")
    await call("load_v2", "POST", "/v1/load_lora_adapter", {"lora_name": "rec-v2", "lora_path": str(files["good"])})
    await call("unload_ok", "POST", "/v1/unload_lora_adapter", {"lora_name": "rec-v1"})
    await call("unload_unknown", "POST", "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    await call("complete_unloaded", "POST", "/v1/completions", completion("rec-v1"))
    await call("metrics", "GET", "/metrics")  # what the gateway's /metrics/engine relays
    # shared mode: the KV cache alone, then the weights too (what release_memory/resume_memory send)
    await call("pause", "POST", "/pause?mode=wait")
    await call("release_kv_cache", "POST", "/release_kv_cache_memory")
    await call("wake_kv_cache", "POST", "/wake_up?tags=kv_cache")
    await generates("complete_after_kv_wake")
    await call("resume", "POST", "/resume")
    await generates("complete_after_resume")
    await call("sleep", "POST", "/sleep?level=1&mode=wait")
    await call("is_sleeping", "GET", "/is_sleeping")
    await call("wake_up", "POST", "/wake_up")
    await generates("complete_after_wake")
    # a full-weight reload (update_weights)
    await call("reload_pause", "POST", "/pause?mode=wait")
    await call("reload_weights", "POST", "/collective_rpc",
               {"method": "reload_weights", "kwargs": {"weights_path": str(files["model"])}})
    await call("weight_version", "POST", "/update_weight_version", {"new_version": "rec-1"})
    await call("reload_resume", "POST", "/resume")
    await generates("complete_after_reload")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["sglang", "vllm", "transformers"], default="sglang")
    parser.add_argument("--sglang-python", default="python3")
    parser.add_argument("--vllm-python", default="python3")
    parser.add_argument("--call-timeout-s", type=float, default=30.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    exchanges = asyncio.run(record(args))
    path = Path(args.out) / f"{args.engine}_recorded.json"
    path.write_text(json.dumps(exchanges, indent=1))
    print(f"wrote {len(exchanges)} exchanges to {path}")
    subprocess.run(["rm", "-rf", str(Path(args.out) / "model"), str(Path(args.out) / "adapters")], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
