"""An engine's HTTP API as tandem calls it, whatever the engine: the plumbing every client shares.

Generation and the rest travel in separate connection pools: rollouts may fill theirs, while
loads, unloads and health checks (the controller's, /ready's) go through their own and never
queue behind them. Each call kind has its timeout, and only idempotent calls are retried, at
this edge (calls.py). Error statuses, error bodies and httpx errors become tandem errors
naming the URL and the adapter (http_errors.py), so nothing of httpx leaves a client. Streams
are server-sent events of JSON objects ending with `data: [DONE]`; only opening one is retried.
A text reply (the engine's metrics) is read once, streamed and bounded in bytes and in time.

An engine's client (sglang.py, vllm.py) subclasses `HttpEngine` and adds its routes, its
bodies, the reading of its replies and of its own words for an adapter it does not hold
(`_adapter_missing`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, ClassVar, Self

import httpx

from tandem.settings import EngineSettings
from tandem_inference.engines.base import METRICS_FORMAT
from tandem_inference.engines.calls import (
    CONNECT_TIMEOUT_S,
    INFO_TIMEOUT_S,
    MAX_ATTEMPTS,
    METRICS_MAX_BYTES,
    METRICS_TIMEOUT_S,
    CallKind,
    retry_pause_s,
    should_retry,
)
from tandem_inference.engines.http_errors import engine_message, message_in, message_of, refusal, unreachable
from tandem_inference.errors import EngineResponseError, EngineTimeout, EngineUnreachable

log = logging.getLogger(__name__)


class HttpEngine:
    """The calls of one engine over HTTP; one per process.

    `http` carries generation; `admin_http` (default: `http`) carries every other call. The
    caller owns both clients and closes them. `api_key` is sent as a bearer token on the calls
    the engine guards (`KEY_ON_GENERATION`: on generation too).
    """

    #: Whether the engine's key guards generation as well (vLLM's one key) or only the rest
    #: (SGLang's admin key).
    KEY_ON_GENERATION: ClassVar[bool] = False

    def __init__(
        self,
        http: httpx.AsyncClient,
        url: str,
        *,
        admin_http: httpx.AsyncClient | None = None,
        api_key: str | None = None,
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
        self._key = api_key
        self.timeouts_s = {
            CallKind.GENERATE: generate_timeout_s,
            CallKind.LOAD: load_timeout_s,
            CallKind.UNLOAD: unload_timeout_s,
            CallKind.INFO: info_timeout_s,
            CallKind.FLUSH: info_timeout_s,
            # Moving weights out of GPU memory and back takes about as long as a load.
            CallKind.MEMORY: load_timeout_s,
            # A full checkpoint is read from disk and copied into the model: minutes for large ones.
            CallKind.WEIGHTS: weights_timeout_s,
            CallKind.METRICS: METRICS_TIMEOUT_S,
        }
        self.max_attempts = max_attempts
        self._metrics_read: asyncio.Task[str] | None = None
        """The one read of the engine's metrics in flight, which every scrape meanwhile shares."""

    @classmethod
    def from_settings(
        cls, http: httpx.AsyncClient, settings: EngineSettings, *, admin_http: httpx.AsyncClient | None = None,
    ) -> Self:
        key = settings.admin_api_key.get_secret_value() if settings.admin_api_key else None
        return cls(http, settings.url, admin_http=admin_http, api_key=key, load_timeout_s=settings.load_timeout_s,
                   unload_timeout_s=settings.unload_timeout_s, generate_timeout_s=settings.generate_timeout_s,
                   **cls.options(settings))

    @staticmethod
    def options(settings: EngineSettings) -> dict[str, Any]:
        """More constructor arguments an engine's client takes from the settings."""
        return {}

    async def health(self) -> bool:
        """True when the engine answers /health with 200; never raises for a down engine."""
        try:
            await self._call(CallKind.INFO, "GET", "/health", max_attempts=1)
        except (EngineUnreachable, EngineResponseError):
            return False
        return True

    # refusals ---------------------------------------------------------------
    @staticmethod
    def _adapter_missing(status: int, message: str, adapter: str | None) -> bool:
        """Whether the engine's refusal of a generation (`status`, `message`) says it does not hold
        the adapter the call named (`adapter`, where the call passed it): each engine says so in its
        own words, which its client matches here; an engine that says nothing of it, never."""
        return False

    def _refusal(
        self, kind: CallKind, url: str, status: int, message: str, adapter: str | None,
    ) -> EngineUnreachable | EngineResponseError:
        """The error for a `kind` call the engine refused (`refusal`, told whether it means a missing adapter)."""
        missing = kind is CallKind.GENERATE and self._adapter_missing(status, message, adapter)
        return refusal(kind, url, status, message, adapter, adapter_missing=missing)

    # plumbing ---------------------------------------------------------------
    def _timeout(self, kind: CallKind) -> httpx.Timeout:
        total = self.timeouts_s[kind]
        return httpx.Timeout(total, connect=min(total, CONNECT_TIMEOUT_S))

    def _headers(self, kind: CallKind) -> dict[str, str]:
        if self._key and (self.KEY_ON_GENERATION or kind is not CallKind.GENERATE):
            return {"Authorization": f"Bearer {self._key}"}
        return {}

    async def _call(
        self, kind: CallKind, method: str, path: str, *, body: Any = None,
        adapter: str | None = None, max_attempts: int | None = None,
    ) -> Any:
        """One call: its decoded JSON (text when it is not JSON, None when empty); an error status or
        `success: false` raises the refusal, an httpx error EngineUnreachable (retried if idempotent)."""
        url = f"{self.url}{path}"
        attempts = max_attempts or self.max_attempts
        http = self.http if kind is CallKind.GENERATE else self.admin_http
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = await http.request(method, url, json=body, headers=self._headers(kind), timeout=self._timeout(kind))
            except httpx.HTTPError as exc:
                if should_retry(kind, exc, attempt, max_attempts=attempts):
                    log.info("engine call %s failed (%s); retrying (attempt %d of %d)", url, exc, attempt + 1, attempts)
                    await asyncio.sleep(retry_pause_s(attempt))
                    continue
                raise unreachable(kind, url, exc, self.timeouts_s[kind], adapter=adapter) from exc
            if resp.status_code >= 400:
                raise self._refusal(kind, url, resp.status_code, engine_message(resp), adapter)
            if not resp.content:
                return None
            try:
                out = resp.json()
            except ValueError:
                return resp.text
            if isinstance(out, dict) and out.get("success") is False:
                raise self._refusal(kind, url, resp.status_code, message_of(out) or "success: false", adapter)
            return out

    async def _metrics(self, path: str = "/metrics") -> str:
        """The engine's metrics text (`_text` of METRICS), read once however many scrapes ask at once.

        A scrape needs no key, so scrapes must not crowd the admin pool that loads, unloads and
        health checks travel in: at most one read is in flight, and the scrapes that arrive
        meanwhile share its answer (or its error). A scrape that goes away leaves it running for
        the others.
        """
        if self._metrics_read is None or self._metrics_read.done():
            self._metrics_read = asyncio.create_task(
                self._text(CallKind.METRICS, path, accept=METRICS_FORMAT, max_bytes=METRICS_MAX_BYTES))
        return await asyncio.shield(self._metrics_read)

    async def _text(self, kind: CallKind, path: str, *, accept: str, max_bytes: int) -> str:
        """The UTF-8 text a GET of `path` answers: one attempt over the admin pool, done within the
        kind's timeout from start to end, and refused past `max_bytes` (read as a stream, so a reply
        that is too long costs no more memory than that).

        An error status raises the refusal, as `_call` does; a reply too long or not UTF-8
        EngineResponseError; an httpx error or the deadline EngineUnreachable (EngineTimeout).
        """
        url = f"{self.url}{path}"
        headers = {**self._headers(kind), "Accept": accept}
        timeout_s = self.timeouts_s[kind]
        try:
            async with asyncio.timeout(timeout_s):
                async with self.admin_http.stream("GET", url, headers=headers, timeout=self._timeout(kind)) as resp:
                    content = await _bounded(resp, max_bytes)
        except httpx.DecodingError as exc:  # a content encoding that does not decode: the engine's answer
            raise EngineResponseError(f"engine at {url} answered the {kind.value} call with a body that does not "
                                      f"decode ({exc})", status_code=502) from exc
        except httpx.HTTPError as exc:
            raise unreachable(kind, url, exc, timeout_s) from exc
        except TimeoutError as exc:
            raise EngineTimeout(f"engine at {url} did not answer the {kind.value} call whole within {timeout_s:g} s; "
                                "it may be overloaded or stuck") from exc
        if content is None:
            raise EngineResponseError(f"engine at {url} answered more than {max_bytes} bytes to the {kind.value} "
                                      "call; nothing of it is relayed", status_code=resp.status_code)
        if resp.status_code >= 400:
            raise self._refusal(kind, url, resp.status_code, message_in(content, resp.status_code), None)
        try:
            return content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EngineResponseError(f"engine at {url} answered the {kind.value} call with text that is not "
                                      f"UTF-8 ({exc.reason} at byte {exc.start})", status_code=resp.status_code) from exc

    async def _events(self, path: str, body: dict[str, Any], *, adapter: str | None) -> AsyncGenerator[dict[str, Any], None]:
        """The JSON objects of a streamed generation until `data: [DONE]`.

        Closing the generator closes the call, which stops the engine generating for it. Only
        opening the stream is retried; an error event inside it raises EngineResponseError with the
        engine's message.
        """
        url = f"{self.url}{path}"
        attempt = 0
        while True:
            attempt += 1
            started = False
            try:
                async with self.http.stream("POST", url, json=body, headers=self._headers(CallKind.GENERATE),
                                            timeout=self._timeout(CallKind.GENERATE)) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise self._refusal(CallKind.GENERATE, url, resp.status_code, engine_message(resp), adapter)
                    async for chunk in _sse(url, resp):
                        started = True
                        yield chunk
                    return
            except httpx.HTTPError as exc:
                retry = should_retry(CallKind.GENERATE, exc, attempt, max_attempts=self.max_attempts)
                if retry and not started:
                    await asyncio.sleep(retry_pause_s(attempt))
                    continue
                raise unreachable(CallKind.GENERATE, url, exc, self.timeouts_s[CallKind.GENERATE]) from exc


async def _bounded(resp: httpx.Response, max_bytes: int) -> bytes | None:
    """The body of a streamed reply (decoded from its content encoding); None past `max_bytes`."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _sse(url: str, resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of server-sent events; an error event raises EngineResponseError."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            chunk = json.loads(payload)
        except ValueError as exc:
            raise EngineResponseError(f"engine at {url} streamed a line that is not JSON: {payload[:200]!r}",
                                      status_code=resp.status_code) from exc
        if not isinstance(chunk, dict):
            raise EngineResponseError(f"engine at {url} streamed {payload[:200]!r}, expected an object",
                                      status_code=resp.status_code)
        if "error" in chunk:
            message = message_of(chunk) or payload[:200]
            raise EngineResponseError(f"engine at {url} failed mid-stream: {message}",
                                      status_code=resp.status_code, engine_message=message)
        yield chunk
