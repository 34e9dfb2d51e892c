"""The engine client: tandem's only way to talk to the engine, over its HTTP API.

The same client drives SGLang in production and the transformers engine on CPU, so it uses
only the SGLang API subset that both serve (see docs: sglang-api.md): native `/generate`,
`/load_lora_adapter`, `/unload_lora_adapter`, `/v1/models`, `/server_info`, `/health`,
`/flush_cache`, `/update_weights_from_disk` and the memory release/resume routes.

Generation and the rest travel in separate connection pools: rollouts may fill theirs, while
loads, unloads and health checks (the controller's, /ready's) go through their own and never
queue behind them. Each call kind has its own timeout (a load may take a minute, a health check
must not), and only idempotent calls are retried, only after connection errors, a bounded number of
times: `should_retry` is the one place that decides. Errors from httpx and error bodies of
the engine are translated into tandem errors whose message names the URL or the adapter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from enum import StrEnum
from typing import Any

import httpx

from tandem.settings import EngineSettings
from tandem_inference.errors import (
    AdapterLoadError,
    EngineError,
    EngineResponseError,
    EngineTimeout,
    EngineUnavailable,
)

log = logging.getLogger(__name__)

#: Attempts of one retryable call (the first try included).
MAX_ATTEMPTS = 3
#: Pause before the second attempt, in seconds; doubles each attempt, capped at RETRY_MAX_PAUSE_S.
RETRY_PAUSE_S = 0.2
RETRY_MAX_PAUSE_S = 2.0
#: Timeout of health, info and cache calls, in seconds.
INFO_TIMEOUT_S = 10.0
#: Longest wait for a TCP connection, in seconds (the engine is on a private network).
CONNECT_TIMEOUT_S = 10.0
#: Connections of the admin pool (loads, unloads, health, info): a few calls at a time.
ADMIN_CONNECTIONS = 8


def pool_limits(max_calls: int) -> httpx.Limits:
    """Limits of a pool with room for `max_calls` calls at once, each on a connection of its own.

    Size the generation pool for every call the gateway admits: a call that waits for a
    connection costs the pool time on every later call (httpcore rescans its queue), so a deep
    queue there stalls the whole process.
    """
    return httpx.Limits(max_connections=max_calls, max_keepalive_connections=max_calls)


class CallKind(StrEnum):
    """What a call does; picks its timeout, its auth and whether it may be retried."""

    GENERATE = "generate"
    LOAD = "load"
    UNLOAD = "unload"
    INFO = "info"
    FLUSH = "flush"
    MEMORY = "memory"
    WEIGHTS = "weights"


#: Calls that change nothing when repeated. A load is not (a second load under the same
#: name is refused), nor is an unload or a memory release.
IDEMPOTENT = frozenset({CallKind.GENERATE, CallKind.INFO, CallKind.FLUSH})

#: httpx errors that mean "the connection failed", not "the engine was slow": a read
#: timeout on a generation is not retried, it would only double the wait.
CONNECTION_ERRORS: tuple[type[httpx.HTTPError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


def should_retry(
    kind: CallKind, exc: BaseException, attempt: int, *, max_attempts: int = MAX_ATTEMPTS
) -> bool:
    """Whether attempt number `attempt` (1-based) of a `kind` call that raised `exc` is retried."""
    return attempt < max_attempts and kind in IDEMPOTENT and isinstance(exc, CONNECTION_ERRORS)


def retry_pause_s(attempt: int) -> float:
    """Pause after failed attempt number `attempt`, in seconds."""
    return min(RETRY_MAX_PAUSE_S, RETRY_PAUSE_S * 2 ** (attempt - 1))


def engine_message(resp: httpx.Response) -> str:
    """The engine's own words from an error body, whatever shape it has.

    SGLang answers `{"error": {"message": ...}}` on /generate, `{"success": false,
    "error_message": ...}` on adapter routes and a flat `{"object": "error", "message": ...}`
    on OpenAI routes; FastAPI answers `{"detail": ...}`.
    """
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500] or f"HTTP {resp.status_code}"
    return _message_of(body) or f"HTTP {resp.status_code}"


def _message_of(body: Any) -> str | None:
    if not isinstance(body, dict):
        return str(body)[:500] if body else None
    err = body.get("error")
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str) and err:
        return err
    for key in ("error_message", "message"):
        if body.get(key):
            return str(body[key])
    detail = body.get("detail")
    if detail:
        return detail if isinstance(detail, str) else json.dumps(detail)[:500]
    return None


class EngineClient:
    """Async client of one engine; one per process.

    `http` carries generation; `admin_http` (default: `http`) carries every other call, so
    that loads, unloads and health checks never wait for a connection behind rollouts. The
    caller owns both clients and closes them.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        base_url: str,
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
        self.base_url = base_url.rstrip("/")
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
    ) -> EngineClient:
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
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        lora_name: str | None = None,
        return_logprob: bool = True,
        *,
        logprob_start_len: int = -1,
    ) -> dict[str, Any]:
        """One native /generate call: `{text, output_ids, meta_info}` (logprobs in meta_info)."""
        body = self._generate_body(input_ids, sampling_params, lora_name, return_logprob, logprob_start_len)
        out = await self._call(CallKind.GENERATE, "POST", "/generate", body=body)
        if not isinstance(out, dict):
            raise EngineResponseError(
                f"engine at {self.base_url}/generate answered {type(out).__name__}, expected an object",
                status_code=200,
            )
        return out

    async def generate_n(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        n: int,
        lora_name: str | None = None,
        return_logprob: bool = True,
        *,
        logprob_start_len: int = -1,
    ) -> list[dict[str, Any]]:
        """`n` samples of one prompt in one /generate call (`sampling_params.n`), in sample order.

        SGLang answers n > 1 with a list of n outputs (the transformers engine too, each with
        its `index`); n = 1 is one output, returned as a list of one.
        """
        params = {**sampling_params, "n": n} if n > 1 else sampling_params
        body = self._generate_body(input_ids, params, lora_name, return_logprob, logprob_start_len)
        out = await self._call(CallKind.GENERATE, "POST", "/generate", body=body)
        outs = out if isinstance(out, list) else [out]
        if len(outs) != n or not all(isinstance(o, dict) for o in outs):
            raise EngineResponseError(
                f"engine at {self.base_url}/generate answered {len(outs)} outputs for n={n}, "
                "expected one object per sample", status_code=200,
            )
        if all(isinstance(o.get("index"), int) for o in outs):
            outs = sorted(outs, key=lambda o: o["index"])
        return outs

    async def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        lora_name: str | None = None,
        return_logprob: bool = True,
        *,
        logprob_start_len: int = -1,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Chunks of a streamed /generate, as the engine sends them, until `data: [DONE]`.

        With `sampling_params["n"] > 1` the samples' chunks interleave, each carrying the
        sample's `index`. Closing the iterator closes the engine call, which stops the engine
        generating for it. Only opening the stream is retried; an error event inside the stream raises
        EngineResponseError with the engine's message.
        """
        body = self._generate_body(input_ids, sampling_params, lora_name, return_logprob, logprob_start_len)
        body["stream"] = True
        url = f"{self.base_url}/generate"
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
                        self._raise_for_status(CallKind.GENERATE, url, resp, adapter=lora_name)
                    async for chunk in self._sse(url, resp):
                        started = True
                        yield chunk
                    return
            except httpx.HTTPError as exc:
                retry = should_retry(CallKind.GENERATE, exc, attempt, max_attempts=self.max_attempts)
                if retry and not started:
                    await asyncio.sleep(retry_pause_s(attempt))
                    continue
                raise self._translate(CallKind.GENERATE, url, exc) from exc

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
                raise EngineResponseError(f"engine at {url} failed mid-stream: {_message_of(chunk)}",
                                          status_code=resp.status_code, engine_message=_message_of(chunk))
            yield chunk

    @staticmethod
    def _generate_body(
        input_ids: Sequence[int], sampling_params: dict[str, Any], lora_name: str | None,
        return_logprob: bool, logprob_start_len: int,
    ) -> dict[str, Any]:
        # top_logprobs_num rides with the sampling params but is a request field in SGLang
        params = {k: v for k, v in sampling_params.items() if k != "top_logprobs_num"}
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": params,
            "return_logprob": return_logprob,
        }
        if return_logprob:
            body["logprob_start_len"] = logprob_start_len
            if sampling_params.get("top_logprobs_num"):
                body["top_logprobs_num"] = sampling_params["top_logprobs_num"]
        if lora_name is not None:
            body["lora_path"] = lora_name
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
    async def update_weights_from_disk(
        self, model_path: str, *, abort_all_requests: bool = False, weight_version: str | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint of the same architecture into the base model in place.

        Returns the engine's `{success, message, ...}`; a refusal (the old weights keep serving)
        raises EngineResponseError with the engine's message.
        """
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = weight_version
        out = await self._call(CallKind.WEIGHTS, "POST", "/update_weights_from_disk", body=body)
        return out if isinstance(out, dict) else {}

    # server -----------------------------------------------------------------
    async def health(self) -> bool:
        """True when the engine answers /health with 200; never raises for a down engine."""
        try:
            await self._call(CallKind.INFO, "GET", "/health", max_attempts=1)
        except (EngineUnavailable, EngineResponseError):
            return False
        return True

    async def server_info(self) -> dict[str, Any]:
        out = await self._call(CallKind.INFO, "GET", "/server_info")
        return out if isinstance(out, dict) else {}

    async def flush_cache(self) -> None:
        await self._call(CallKind.FLUSH, "POST", "/flush_cache")

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Free GPU memory (weights and KV cache, or only `tags`) for a trainer on the same GPU."""
        await self._call(CallKind.MEMORY, "POST", "/release_memory_occupation", body={"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._call(CallKind.MEMORY, "POST", "/resume_memory_occupation", body={"tags": tags})

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
        url = f"{self.base_url}{path}"
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
                raise self._translate(kind, url, exc, adapter=adapter) from exc
            self._raise_for_status(kind, url, resp, adapter=adapter)
            if not resp.content:
                return None
            try:
                out = resp.json()
            except ValueError:
                return resp.text
            if isinstance(out, dict) and out.get("success") is False:
                self._raise(kind, url, resp.status_code, _message_of(out) or "success: false", adapter)
            return out

    def _raise_for_status(
        self, kind: CallKind, url: str, resp: httpx.Response, *, adapter: str | None
    ) -> None:
        if resp.status_code >= 400:
            self._raise(kind, url, resp.status_code, engine_message(resp), adapter)

    def _raise(self, kind: CallKind, url: str, status: int, message: str, adapter: str | None) -> None:
        if status == 503:
            raise EngineUnavailable(f"engine at {url} is not ready (503): {message}")
        if kind is CallKind.LOAD:
            raise AdapterLoadError(
                f"engine at {url} refused to load adapter {adapter!r} ({status}): {message}",
                adapter=adapter, status_code=status, engine_message=message,
            )
        what = kind.value
        if adapter and kind is not CallKind.GENERATE:
            what = f"{kind.value} of adapter {adapter!r}"
        raise EngineResponseError(
            f"engine at {url} failed the {what} ({status}): {message}",
            status_code=status, engine_message=message,
        )

    def _translate(
        self, kind: CallKind, url: str, exc: httpx.HTTPError, *, adapter: str | None = None
    ) -> EngineError:
        about = f" (adapter {adapter!r})" if adapter else ""
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return EngineTimeout(
                f"engine at {url} did not answer the {kind.value}{about} within {self.timeouts_s[kind]:g} s; "
                f"it may be overloaded or stuck"
            )
        return EngineUnavailable(
            f"engine at {url} cannot be reached for the {kind.value}{about}: {type(exc).__name__}: {exc}; "
            "is it running? check TANDEM_ENGINE__URL"
        )

