"""SGLang behind the `Engine` protocol: its HTTP API, its field names and its error shapes.

tandem's controller and gateway live in one Python environment, SGLang in another; they meet
only over SGLang's HTTP API (docs/architecture.md, "Engines"): native `/generate`, `/load_lora_adapter`,
`/unload_lora_adapter`, `/v1/models`, `/server_info`, `/health`, `/flush_cache`,
`/update_weights_from_disk`, the memory release/resume routes and `/metrics` (the launcher passes
`--enable-metrics`). Replies become `Generated` (sglang_outputs.py).

The two connection pools, timeouts and retries per call kind and the translation of errors are
every HTTP engine's (http.py); SGLang's words for an adapter it does not hold are read here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from tandem_inference.engines.base import EngineInfo, Generated, Sampling
from tandem_inference.engines.calls import CallKind
from tandem_inference.engines.http import HttpEngine
from tandem_inference.engines.sglang_outputs import SampleFold, whole
from tandem_inference.errors import EngineResponseError

#: How SGLang refuses a generation naming an adapter it does not hold (0.5.23: 400, "Got LoRA adapter
#: that has never been loaded: <name>..."); the transformers engine refuses in the same words.
NOT_LOADED = "never been loaded"


class SGLangEngine(HttpEngine):
    """Async client of one SGLang server (or of an engine that serves the same routes); one per process.

    `api_key` is SGLang's `--admin-api-key`: it guards load/unload, flush, memory and /server_info
    (ADMIN_OPTIONAL), not generation, which `--api-key` would guard and tandem leaves unset.
    """

    @staticmethod
    def _adapter_missing(status: int, message: str, adapter: str | None) -> bool:
        return NOT_LOADED in message

    # generation -------------------------------------------------------------
    async def complete(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, n: int = 1, adapter: str | None = None,
        logprobs: bool = True,
    ) -> list[Generated]:
        """`n` samples of one prompt in one native /generate call (`sampling_params.n`), in sample order.

        SGLang answers n > 1 with a list of n outputs, each naming its `index`; n = 1 with one output.
        """
        out = await self._call(CallKind.GENERATE, "POST", "/generate",
                               body=self._generate_body(prompt_ids, sampling, n, adapter, logprobs))
        outs = out if isinstance(out, list) else [out]
        if len(outs) != n or not all(isinstance(o, dict) for o in outs):
            raise EngineResponseError(
                f"engine at {self.url}/generate answered {len(outs)} outputs for n={n}, "
                "expected one object per sample", status_code=200,
            )
        if n > 1 and all(isinstance(o.get("index"), int) for o in outs):
            outs = sorted(outs, key=lambda o: o["index"])
        return [whole(o, i) for i, o in enumerate(outs)]

    async def stream(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, n: int = 1, adapter: str | None = None,
        logprobs: bool = True,
    ) -> AsyncGenerator[Generated, None]:
        """Increments of a streamed /generate until `data: [DONE]`; n > 1 interleaves samples by `index`.

        Closing the iterator closes the engine call, which stops the engine generating for it.
        Only opening the stream is retried; an error event inside the stream raises
        EngineResponseError with the engine's message.
        """
        body = self._generate_body(prompt_ids, sampling, n, adapter, logprobs)
        body["stream"] = True
        folds = [SampleFold(i, sampling.stop) for i in range(n)]
        async for chunk in self._events("/generate", body, adapter=adapter):
            i = chunk.get("index", 0) if n > 1 else 0
            if not isinstance(i, int) or not 0 <= i < n:
                raise EngineResponseError(
                    f"engine at {self.url}/generate streamed a chunk of sample {i!r}, expected 0..{n - 1}",
                    status_code=200)
            yield folds[i].add(chunk)

    @staticmethod
    def _generate_body(
        prompt_ids: Sequence[int], sampling: Sampling, n: int, adapter: str | None, logprobs: bool,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                                  "top_p": sampling.top_p}
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.ignore_eos:
            params["ignore_eos"] = True
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if n > 1:
            params["n"] = n
        body: dict[str, Any] = {"input_ids": list(prompt_ids), "sampling_params": params, "return_logprob": logprobs}
        if logprobs:
            body["logprob_start_len"] = -1  # the completion's tokens only
            if sampling.top_logprobs:
                body["top_logprobs_num"] = sampling.top_logprobs
        if adapter is not None:
            body["lora_path"] = adapter
        return body

    # adapters ---------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> float:
        """Load the adapter directory `path` under `name`; returns the load time in ms."""
        t0 = time.perf_counter()
        await self._call(CallKind.LOAD, "POST", "/load_lora_adapter",
                         body={"lora_name": name, "lora_path": path}, adapter=name)
        return (time.perf_counter() - t0) * 1000.0

    async def unload_adapter(self, name: str) -> None:
        """Unload `name`; the engine first lets requests that use it finish (SGLang does)."""
        await self._call(CallKind.UNLOAD, "POST", "/unload_lora_adapter", body={"lora_name": name},
                         adapter=name)

    async def loaded_adapters(self) -> dict[str, str]:
        """Adapters the engine holds now, name -> path, from /v1/models (the base card excluded)."""
        out = await self._call(CallKind.INFO, "GET", "/v1/models")
        cards = out.get("data", []) if isinstance(out, dict) else []
        return {
            str(card["id"]): str(card.get("root") or "")
            for card in cards
            if isinstance(card, dict) and card.get("parent")
        }

    # full weights -----------------------------------------------------------
    async def update_weights(
        self, model_path: str, *, abort_all_requests: bool = False, version: str | None = None,
    ) -> str:
        """/update_weights_from_disk: a checkpoint of the same architecture loaded into the base model in place.

        Returns the engine's message; a refusal (the old weights keep serving) raises
        EngineResponseError with the engine's message.
        """
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if version is not None:
            body["weight_version"] = version
        out = await self._call(CallKind.WEIGHTS, "POST", "/update_weights_from_disk", body=body)
        return str(out.get("message") or "") if isinstance(out, dict) else ""

    # server -----------------------------------------------------------------
    async def info(self) -> EngineInfo:
        """The context length and highest LoRA rank from /server_info."""
        out = await self._call(CallKind.INFO, "GET", "/server_info")
        out = out if isinstance(out, dict) else {}
        return EngineInfo(context_length=_positive(out.get("context_length")),
                          max_lora_rank=_positive(out.get("max_lora_rank")))

    async def flush_cache(self) -> None:
        await self._call(CallKind.FLUSH, "POST", "/flush_cache")

    async def metrics(self) -> str:
        """SGLang's /metrics (`sglang:*`: running and queued requests, KV-cache usage, tokens and
        throughput), or the transformers engine's (`tandem_engine_*`)."""
        return await self._metrics()

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (weights and KV cache, or only `tags`) for a trainer on the same GPU."""
        await self._call(CallKind.MEMORY, "POST", "/release_memory_occupation", body=_tags(tags))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        await self._call(CallKind.MEMORY, "POST", "/resume_memory_occupation", body=_tags(tags))


def _positive(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _tags(tags: Sequence[str] | None) -> dict[str, list[str] | None]:
    """The body of a memory release or resume: which memory (None: all of it)."""
    return {"tags": None if tags is None else list(tags)}
