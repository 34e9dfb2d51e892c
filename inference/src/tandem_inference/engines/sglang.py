"""SGLang behind the `Engine` protocol: its HTTP API, its field names and its error shapes.

tandem's controller and gateway live in one Python environment, SGLang in another; they meet
only over SGLang's HTTP API (docs/architecture.md, "Engines"): native `/generate`, `/load_lora_adapter`,
`/unload_lora_adapter`, `/v1/models`, `/server_info`, `/health`, `/flush_cache`,
`/update_weights_from_disk` and the memory release/resume routes. Replies become `Generated`
(sglang_outputs.py).

Generation and the rest travel in separate connection pools: rollouts may fill theirs, while
loads, unloads and health checks (the controller's, /ready's) go through their own and never
queue behind them. Timeouts and retries are decided per call kind (calls.py); httpx errors and
error bodies of the engine become tandem errors naming the URL or the adapter (http_errors.py),
so nothing of httpx leaves this client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import httpx

from tandem.settings import EngineSettings
from tandem_inference.engines.base import EngineInfo, Generated, Sampling
from tandem_inference.engines.calls import (
    CONNECT_TIMEOUT_S,
    INFO_TIMEOUT_S,
    MAX_ATTEMPTS,
    CallKind,
    retry_pause_s,
    should_retry,
)
from tandem_inference.engines.http_errors import engine_message, message_of, refusal, unreachable
from tandem_inference.engines.sglang_outputs import SampleFold, whole
from tandem_inference.errors import EngineResponseError, EngineUnreachable

log = logging.getLogger(__name__)


class SGLangEngine:
    """Async client of one SGLang server (or of an engine that serves the same routes); one per process.

    `http` carries generation; `admin_http` (default: `http`) carries every other call, so
    that loads, unloads and health checks never wait for a connection behind rollouts. The
    caller owns both clients and closes them.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        url: str,
        *,
        admin_http: httpx.AsyncClient | None = None,
        admin_api_key: str | None = None,
        load_timeout_s: float = 60.0,
        unload_timeout_s: float = 30.0,
        generate_timeout_s: float = 300.0,
        info_timeout_s: float = INFO_TIMEOUT_S,
        weights_timeout_s: float = 600.0,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.http = http
        self.admin_http = admin_http if admin_http is not None else http
        self.url = url.rstrip("/")
        self._admin_key = admin_api_key
        self.timeouts_s = {
            CallKind.GENERATE: generate_timeout_s,
            CallKind.LOAD: load_timeout_s,
            CallKind.UNLOAD: unload_timeout_s,
            CallKind.INFO: info_timeout_s,
            CallKind.FLUSH: info_timeout_s,
            # Moving weights out of and back into GPU memory takes about as long as a load.
            CallKind.MEMORY: load_timeout_s,
            # A full checkpoint is read from disk and copied into the model: minutes for large ones.
            CallKind.WEIGHTS: weights_timeout_s,
        }
        self.max_attempts = max_attempts

    @classmethod
    def from_settings(
        cls, http: httpx.AsyncClient, settings: EngineSettings, *, admin_http: httpx.AsyncClient | None = None,
    ) -> SGLangEngine:
        key = settings.admin_api_key.get_secret_value() if settings.admin_api_key else None
        return cls(
            http,
            settings.url,
            admin_http=admin_http,
            admin_api_key=key,
            load_timeout_s=settings.load_timeout_s,
            unload_timeout_s=settings.unload_timeout_s,
            generate_timeout_s=settings.generate_timeout_s,
        )

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
        url = f"{self.url}/generate"
        attempt = 0
        while True:
            attempt += 1
            started = False
            try:
                async with self.http.stream(
                    "POST", url, json=body, headers=self._headers(CallKind.GENERATE),
                    timeout=self._timeout(CallKind.GENERATE),
                ) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        self._raise_for_status(CallKind.GENERATE, url, resp, adapter=adapter)
                    async for chunk in self._sse(url, resp):
                        started = True
                        i = chunk.get("index", 0) if n > 1 else 0
                        if not isinstance(i, int) or not 0 <= i < n:
                            raise EngineResponseError(
                                f"engine at {url} streamed a chunk of sample {i!r}, expected 0..{n - 1}",
                                status_code=200)
                        yield folds[i].add(chunk)
                    return
            except httpx.HTTPError as exc:
                retry = should_retry(CallKind.GENERATE, exc, attempt, max_attempts=self.max_attempts)
                if retry and not started:
                    await asyncio.sleep(retry_pause_s(attempt))
                    continue
                raise unreachable(CallKind.GENERATE, url, exc, self.timeouts_s[CallKind.GENERATE]) from exc

    async def _sse(self, url: str, resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            try:
                chunk = json.loads(payload)
            except ValueError as exc:
                raise EngineResponseError(
                    f"engine at {url} streamed a line that is not JSON: {payload[:200]!r}",
                    status_code=resp.status_code,
                ) from exc
            if isinstance(chunk, dict) and "error" in chunk:
                raise EngineResponseError(f"engine at {url} failed mid-stream: {message_of(chunk)}",
                                          status_code=resp.status_code, engine_message=message_of(chunk))
            yield chunk

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
    async def health(self) -> bool:
        """True when the engine answers /health with 200; never raises for a down engine."""
        try:
            await self._call(CallKind.INFO, "GET", "/health", max_attempts=1)
        except (EngineUnreachable, EngineResponseError):
            return False
        return True

    async def info(self) -> EngineInfo:
        """The context length and highest LoRA rank from /server_info."""
        out = await self._call(CallKind.INFO, "GET", "/server_info")
        out = out if isinstance(out, dict) else {}
        return EngineInfo(context_length=_positive(out.get("context_length")),
                          max_lora_rank=_positive(out.get("max_lora_rank")))

    async def flush_cache(self) -> None:
        await self._call(CallKind.FLUSH, "POST", "/flush_cache")

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (weights and KV cache, or only `tags`) for a trainer on the same GPU."""
        await self._call(CallKind.MEMORY, "POST", "/release_memory_occupation", body=_tags(tags))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        await self._call(CallKind.MEMORY, "POST", "/resume_memory_occupation", body=_tags(tags))

    # plumbing ---------------------------------------------------------------
    def _timeout(self, kind: CallKind) -> httpx.Timeout:
        total = self.timeouts_s[kind]
        return httpx.Timeout(total, connect=min(total, CONNECT_TIMEOUT_S))

    def _headers(self, kind: CallKind) -> dict[str, str]:
        # NOTE: SGLang's --admin-api-key guards load/unload, flush, memory and /server_info
        # (ADMIN_OPTIONAL); generation routes are guarded by --api-key, which tandem leaves unset.
        if self._admin_key and kind is not CallKind.GENERATE:
            return {"Authorization": f"Bearer {self._admin_key}"}
        return {}

    async def _call(
        self, kind: CallKind, method: str, path: str, *, body: Any = None,
        adapter: str | None = None, max_attempts: int | None = None,
    ) -> Any:
        url = f"{self.url}{path}"
        attempts = max_attempts or self.max_attempts
        attempt = 0
        while True:
            attempt += 1
            http = self.http if kind is CallKind.GENERATE else self.admin_http
            try:
                resp = await http.request(
                    method, url, json=body, headers=self._headers(kind), timeout=self._timeout(kind)
                )
            except httpx.HTTPError as exc:
                if should_retry(kind, exc, attempt, max_attempts=attempts):
                    log.info("engine call %s failed (%s); retrying (attempt %d of %d)",
                             url, exc, attempt + 1, attempts)
                    await asyncio.sleep(retry_pause_s(attempt))
                    continue
                raise unreachable(kind, url, exc, self.timeouts_s[kind], adapter=adapter) from exc
            self._raise_for_status(kind, url, resp, adapter=adapter)
            if not resp.content:
                return None
            try:
                out = resp.json()
            except ValueError:
                return resp.text
            if isinstance(out, dict) and out.get("success") is False:
                raise refusal(kind, url, resp.status_code, message_of(out) or "success: false", adapter)
            return out

    def _raise_for_status(
        self, kind: CallKind, url: str, resp: httpx.Response, *, adapter: str | None
    ) -> None:
        if resp.status_code >= 400:
            raise refusal(kind, url, resp.status_code, engine_message(resp), adapter)


def _positive(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _tags(tags: Sequence[str] | None) -> dict[str, list[str] | None]:
    """The body of a memory release or resume: which memory (None: all of it)."""
    return {"tags": None if tags is None else list(tags)}
