"""vLLM behind the `Engine` protocol: its HTTP API, its field names and its error shapes.

vLLM (0.33) runs in an environment of its own and meets tandem only over HTTP
(docs/architecture.md, "Engines"):

- generation: `POST /v1/completions` with the prompt as token ids, `return_token_ids` and
  `return_tokens_as_token_ids` (ids in, ids and logprobs out), `n` samples in one call,
  streamed as SSE with a per-choice `index` (vllm_outputs.py folds the replies). An adapter is
  picked by `model: <adapter name>`, the base model by the served model name;
- adapters: `POST /v1/load_lora_adapter {lora_name, lora_path}` and `/v1/unload_lora_adapter
  {lora_name}` (with VLLM_ALLOW_RUNTIME_LORA_UPDATING), listed by `GET /v1/models` (cards with a
  `parent` are adapters, `root` their path; the base card's `max_model_len` is the context length);
- with VLLM_SERVER_DEV_MODE: `/sleep`, `/wake_up`, `/pause`, `/release_kv_cache_memory` (lending
  GPU memory), `/reset_prefix_cache`, `/collective_rpc` (full-weight reloads), `/update_weight_version`;
- `GET /health`, and `GET /metrics` (`vllm:*`, served by default).

vLLM's unload only forgets the name: requests already running on the adapter finish on it (the
worker keeps its weights in its LRU cache), so unloading never waits. tandem never loads two
versions under one name (a same-name reload reuses stale prefix-cache blocks, vllm#42125).

vLLM has one key, its API key, which guards `/v1` (generation included), not the dev routes:
this client sends `engine.admin_api_key` on every call, and the launcher keeps vLLM on loopback.
Connection pools, timeouts, retries and error translation are every HTTP engine's (http.py);
vLLM's words for an adapter it does not hold are read here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, ClassVar

import httpx

from tandem.settings import EngineSettings
from tandem_inference.engines.base import EngineInfo, Generated, Sampling
from tandem_inference.engines.calls import CallKind
from tandem_inference.engines.http import HttpEngine
from tandem_inference.engines.vllm_outputs import cached_tokens, choice_output
from tandem_inference.errors import EngineResponseError

#: What vLLM's sleep and wake routes name memory by (0.33: the executor's allocation tags).
MEMORY_TAGS = ("weights", "kv_cache")
#: How vLLM refuses a generation naming an adapter it does not hold (0.33: 404, "The model `<name>`
#: does not exist. Valid aliases: ...").
NO_SUCH_MODEL = "does not exist"


class VLLMEngine(HttpEngine):
    """Async client of one vLLM server; one per process.

    `api_key` is vLLM's one key (`VLLM_API_KEY`): its middleware guards every /v1 route,
    generation included (0.33), so it rides on every call.
    """

    KEY_ON_GENERATION: ClassVar[bool] = True

    def __init__(self, http: httpx.AsyncClient, url: str, *, served_model_name: str = "base",
                 max_lora_rank: int | None = None, **calls: Any) -> None:
        super().__init__(http, url, **calls)
        self.served_model_name = served_model_name
        self.max_lora_rank = max_lora_rank
        """The rank vLLM was started with (`--max-lora-rank`); vLLM does not report it."""

    @staticmethod
    def options(settings: EngineSettings) -> dict[str, Any]:
        return {"served_model_name": settings.served_model_name, "max_lora_rank": settings.max_lora_rank}

    @staticmethod
    def _adapter_missing(status: int, message: str, adapter: str | None) -> bool:
        return status == 404 and bool(adapter) and NO_SUCH_MODEL in message

    async def complete(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, n: int = 1, adapter: str | None = None,
        logprobs: bool = True,
    ) -> list[Generated]:
        """`n` samples of one prompt in one /v1/completions call, in sample order."""
        body = self._completion_body(prompt_ids, sampling, n, adapter, logprobs)
        out = await self._call(CallKind.GENERATE, "POST", "/v1/completions", body=body, adapter=adapter)
        choices = out.get("choices") if isinstance(out, dict) else None
        if not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices):
            got = len(choices) if isinstance(choices, list) else "no"
            raise EngineResponseError(
                f"engine at {self.url}/v1/completions answered {got} choices for n={n}, expected one per sample",
                status_code=200)
        url = f"{self.url}/v1/completions"
        outs = sorted((choice_output(c, top_k=sampling.top_logprobs, url=url) for c in choices),
                      key=lambda g: g.index)
        if [g.index for g in outs] != list(range(n)):
            raise EngineResponseError(
                f"engine at {url} answered choices {[g.index for g in outs]} for n={n}", status_code=200)
        cached = cached_tokens(out.get("usage"))
        for g in outs:
            g.cached_tokens = cached
        return outs

    async def stream(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, n: int = 1, adapter: str | None = None,
        logprobs: bool = True,
    ) -> AsyncGenerator[Generated, None]:
        """Increments of a streamed /v1/completions until `data: [DONE]`; n > 1 interleaves by `index`.

        Closing the iterator closes the engine call, which aborts the request in vLLM. Only
        opening the stream is retried; an error event inside the stream raises
        EngineResponseError with the engine's message.
        """
        body = self._completion_body(prompt_ids, sampling, n, adapter, logprobs)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        url = f"{self.url}/v1/completions"
        async for chunk in self._events("/v1/completions", body, adapter=adapter):
            for choice in chunk.get("choices") or []:
                new = choice_output(choice, top_k=sampling.top_logprobs, url=url)
                if not 0 <= new.index < n:
                    raise EngineResponseError(
                        f"engine at {url} streamed a chunk of sample {new.index}, expected 0..{n - 1}", status_code=200)
                yield new
            cached = cached_tokens(chunk.get("usage"))
            if cached is not None:  # the last chunk: usage only
                yield Generated(index=0, cached_tokens=cached)

    def _completion_body(
        self, prompt_ids: Sequence[int], sampling: Sampling, n: int, adapter: str | None, logprobs: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": adapter if adapter is not None else self.served_model_name,
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "n": n,
            "return_token_ids": True,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.ignore_eos:
            body["ignore_eos"] = True
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if logprobs:
            # `logprobs: k` lists the sampled token and the k best; ids instead of texts tell them apart.
            body["logprobs"] = sampling.top_logprobs
            body["return_tokens_as_token_ids"] = True
        return body

    # adapters ---------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> float:
        """Load the adapter directory `path` under the new name `name`; returns the load time in ms."""
        t0 = time.perf_counter()
        await self._call(CallKind.LOAD, "POST", "/v1/load_lora_adapter",
                         body={"lora_name": name, "lora_path": path}, adapter=name)
        return (time.perf_counter() - t0) * 1000.0

    async def unload_adapter(self, name: str) -> None:
        """Forget `name`; requests already running on it finish on it (vLLM keeps their weights)."""
        await self._call(CallKind.UNLOAD, "POST", "/v1/unload_lora_adapter", body={"lora_name": name}, adapter=name)

    async def loaded_adapters(self) -> dict[str, str]:
        """Adapters vLLM holds now, name -> path: the /v1/models cards that have a `parent`."""
        return {str(c["id"]): str(c.get("root") or "") for c in await self._cards() if c.get("parent")}

    # server -----------------------------------------------------------------
    async def info(self) -> EngineInfo:
        """The context length (the base card's `max_model_len`) and the rank vLLM was started with."""
        base = [c for c in await self._cards() if not c.get("parent")]
        length = base[0].get("max_model_len") if base else None
        return EngineInfo(context_length=length if type(length) is int and length > 0 else None,
                          max_lora_rank=self.max_lora_rank)

    async def flush_cache(self) -> None:
        """Empty the prefix cache (`success: false` while blocks are in use raises EngineResponseError)."""
        await self._call(CallKind.FLUSH, "POST", "/reset_prefix_cache")

    async def metrics(self) -> str:
        """vLLM's /metrics (`vllm:*`: running and waiting requests, KV-cache usage, tokens, the LoRA
        adapters running and waiting)."""
        return await self._metrics()

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory for a trainer on the same GPU (no request may be running).

        With the weights (or `tags` None): sleep level 1, the weights copied to the CPU and the
        KV cache dropped. The KV cache alone: pause the scheduler, then drop the KV cache; the
        weights stay. vLLM needs `--enable-sleep-mode` (the launcher sets it in shared mode with release tags).
        """
        if tags is None or "weights" in tags:
            await self._call(CallKind.MEMORY, "POST", "/sleep?level=1&mode=wait")
            return
        if "kv_cache" in tags:
            await self._call(CallKind.MEMORY, "POST", "/pause?mode=wait")
            await self._call(CallKind.MEMORY, "POST", "/release_kv_cache_memory")

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back what `release_memory(tags)` freed; vLLM schedules again once all of it is back."""
        if tags is None or "weights" in tags:
            path = "/wake_up"
        elif "kv_cache" in tags:
            path = "/wake_up?tags=kv_cache"
        else:
            return
        out = await self._call(CallKind.MEMORY, "POST", path)
        if isinstance(out, dict) and out.get("status") not in (None, "awake"):
            raise EngineResponseError(
                f"engine at {self.url}{path} left part of its memory asleep ({out}); wake it with "
                f"POST {self.url}/wake_up", status_code=200, engine_message=str(out))

    async def update_weights(
        self, model_path: str, *, abort_all_requests: bool = False, version: str | None = None,
    ) -> str:
        """Reload the base weights from the checkpoint at `model_path` in place (vLLM's
        `reload_weights` through /collective_rpc), between a pause and a resume.

        The pause waits for running requests (or aborts them with `abort_all_requests`) and empties
        the prefix cache; the resume runs even when the reload fails. A refusal raises
        EngineResponseError with vLLM's message; vLLM's worker reports a failed reload as an
        error, so the old weights may be partly overwritten then: restart the engine.
        """
        mode = "abort" if abort_all_requests else "wait"
        await self._call(CallKind.WEIGHTS, "POST", f"/pause?mode={mode}")
        try:
            await self._call(CallKind.WEIGHTS, "POST", "/collective_rpc",
                             body={"method": "reload_weights", "kwargs": {"weights_path": model_path}})
            if version is not None:
                await self._call(CallKind.WEIGHTS, "POST", "/update_weight_version", body={"new_version": version})
        finally:
            await self._call(CallKind.WEIGHTS, "POST", "/resume")
        return f"weights reloaded from {model_path}"

    # plumbing ---------------------------------------------------------------
    async def _cards(self) -> list[dict[str, Any]]:
        out = await self._call(CallKind.INFO, "GET", "/v1/models")
        cards = out.get("data") if isinstance(out, dict) else None
        return [c for c in cards if isinstance(c, dict) and "id" in c] if isinstance(cards, list) else []
