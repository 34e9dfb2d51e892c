"""The OpenAI-compatible gateway: rollouts go in by run name, token ids and logprobs come out.

Clients name a run (`model="digits"`), a pinned version (`digits@v7`) or the base model; the
routing table picks the adapter. The gateway applies the chat template itself with the base
model's tokenizer and calls the engine's native `/generate` with `input_ids`, so the response
can carry the exact prompt and completion token ids and their logprobs for training, with no
re-tokenisation anywhere. Responses are OpenAI-shaped (any OpenAI client works) plus a
`tandem` object and `x-tandem-run` / `x-tandem-version` headers saying which version served.

A request's `n` samples are one engine call (`sampling_params.n`), or n calls with
`gateway.fan_out_n` (SGLang's unload can deadlock after n>1 sampling). Generation is admitted
within a budget (capacity.py): beyond it requests wait in a bounded queue, then are refused with
429 and Retry-After. A client that leaves ends its engine calls, streamed or not, so the engine
stops generating for nobody. Each request holds the in-flight count of its version until its
response (or stream) ends, so the controller never unloads a version under a running request.

Bad input is a 4xx in OpenAI's error shape naming the field (bodies.py); a generation the
engine refuses for what the client asked (a prompt longer than the context) is a 400, not a 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import anyio
import redis
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.errors import BackendUnavailable, TandemError
from tandem.registry import Registry
from tandem.runs import RUN_NAME
from tandem.settings import InferenceSettings
from tandem_inference.bodies import (
    MAX_TOP_LOGPROBS,
    Body,
    ChatLogprobs,
    by_text,
    client_left,
    error_response,
    invalid_request,
)
from tandem_inference.capacity import Capacity, Permit
from tandem_inference.controller import Controller
from tandem_inference.engine_client import EngineClient
from tandem_inference.errors import EngineError, EngineResponseError, EngineUnavailable, ModelNotFound, Overloaded
from tandem_inference.routing import Lease, Route, RoutingTable, parse_model
from tandem_inference.sharing import Admission
from tandem_inference.stops import sendable

log = logging.getLogger("tandem.gateway")

DEFAULT_MAX_TOKENS = 128
MAX_N = 64
_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


# requests -------------------------------------------------------------------
MAX_MODEL_CHARS = 256
"""Longest `model` accepted: a run name (63), `@v` and a version fit many times over."""


class _Body(Body):
    """Unknown OpenAI fields (user, stream_options, ...) are ignored, not refused; NaN,
    Infinity and lone surrogates are refused anywhere (see bodies.py)."""


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class _Sampling(_Body):
    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False

    @property
    def top_logprobs_num(self) -> int:
        """How many alternatives per token the reply lists (0: none)."""
        return 0


class ChatRequest(ChatLogprobs, _Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives per token in `logprobs.content[].top_logprobs`; needs `logprobs: true`."""


class CompletionRequest(_Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """OpenAI's completions API takes a count here: any value asks for logprobs, and that many
    alternatives per token come back in `top_logprobs`."""

    @property
    def top_logprobs_num(self) -> int:
        return self.logprobs or 0


# engine outputs -------------------------------------------------------------
def _finish_reason(meta: dict[str, Any]) -> str | None:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind is None:
        return None
    return "length" if kind == "length" else "stop"


TopLogprobs = list[tuple[float, int, str | None]]
"""The alternatives at one position, as SGLang's `output_top_logprobs` lists them: (logprob, id, text)."""


@dataclass
class Output:
    """One choice as the engine produced it, built from a whole result or from stream chunks.

    SGLang streams cumulative or incremental chunks depending on its version and flags; the
    cumulative count `meta_info.completion_tokens` tells which, and the text follows the tokens,
    so both are handled. The engine cuts the text where a stop string begins once the stop
    string is whole, so while it may still be arriving, text that could begin one of `stops`
    is held back (stops.py): streamed deltas add up to the unstreamed text.
    """

    stops: Sequence[str] = ()
    """The request's stop strings."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str | None] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    """Per token, the alternatives the engine listed (None where it listed none)."""
    finish_reason: str | None = None
    cached_tokens: int = 0
    """Prompt tokens the engine's prefix cache served (SGLang's meta_info.cached_tokens)."""
    _sent: int = field(default=0, repr=False)
    """How much of `text` was handed out as deltas."""

    def update(self, chunk: dict[str, Any]) -> tuple[str, int]:
        """Fold in one chunk; returns (new text, index of the first new token)."""
        meta = chunk.get("meta_info") or {}
        total = meta.get("completion_tokens")
        start = len(self.token_ids)
        cumulative: bool | None = None  # unknown without token ids: then the text tells
        triples = meta.get("output_token_logprobs")
        if triples:
            ids = [int(t[1]) for t in triples]
            cumulative = self._cumulative(ids, total)
            keep = 0 if cumulative else len(self.token_ids)
            tops = list(meta.get("output_top_logprobs") or [])[: len(triples)]
            tops += [None] * (len(triples) - len(tops))
            self.token_ids = self.token_ids[:keep] + ids
            self.logprobs = self.logprobs[:keep] + [float(t[0]) for t in triples]
            self.token_texts = self.token_texts[:keep] + [t[2] if len(t) > 2 else None for t in triples]
            self.top_logprobs = self.top_logprobs[:keep] + [_alternatives(t) for t in tops]
        elif chunk.get("output_ids") is not None:
            ids = [int(i) for i in chunk["output_ids"]]
            cumulative = self._cumulative(ids, total)
            keep = 0 if cumulative else len(self.token_ids)
            self.token_ids = self.token_ids[:keep] + ids
        text = chunk.get("text")
        if isinstance(text, str):
            if cumulative is None:
                cumulative = text.startswith(self.text.rstrip("\ufffd"))
            self.text = text if cumulative else self.text + text
        self.finish_reason = _finish_reason(meta) or self.finish_reason
        if isinstance(meta.get("cached_tokens"), int):
            self.cached_tokens = meta["cached_tokens"]
        visible = self.text if self.finish_reason else sendable(self.text, self.stops)
        delta = visible[self._sent:]
        self._sent = max(self._sent, len(visible))
        return delta, min(start, len(self.token_ids))

    def _cumulative(self, ids: list[int], total: Any) -> bool:
        """Whether `ids` repeat every token so far (cumulative chunk) rather than only new ones."""
        if isinstance(total, int):
            return len(ids) == total
        return len(ids) >= len(self.token_ids) and ids[: len(self.token_ids)] == self.token_ids


def _alternatives(entry: Any) -> TopLogprobs | None:
    """One position of SGLang's `output_top_logprobs` ([[logprob, id, text or null], ...] or null)."""
    if not isinstance(entry, list):
        return None
    return [(float(t[0]), int(t[1]), t[2] if len(t) > 2 else None) for t in entry]


# metrics --------------------------------------------------------------------
class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("tandem_gateway_requests", "Requests by route, model and status.",
                                ["route", "model", "status"], registry=registry)
        self.latency = Histogram("tandem_gateway_request_seconds", "Time to the end of the response.",
                                 ["route"],
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                 registry=registry)
        self.in_flight = Gauge("tandem_gateway_in_flight", "Generation requests in flight.",
                               registry=registry)
        self.queued = Gauge("tandem_gateway_queued_requests", "Generation requests waiting for room.",
                            registry=registry)
        self.in_flight_sequences = Gauge("tandem_gateway_in_flight_sequences",
                                         "Samples admitted to the engine (each request's n).", registry=registry)
        self.in_flight_tokens = Gauge("tandem_gateway_in_flight_tokens",
                                      "Tokens admitted to the engine (n * max_tokens of each request).",
                                      registry=registry)
        self.refused = Counter("tandem_gateway_refused", "Requests refused with 429, by reason.", ["reason"],
                               registry=registry)
        for reason in ("queue_full", "queue_timeout"):
            self.refused.labels(reason)
        self.queue_wait = Histogram("tandem_gateway_queue_wait_seconds", "Time admitted requests waited for room.",
                                    buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300), registry=registry)
        self.cancelled = Counter("tandem_gateway_cancelled", "Requests whose client left before their end; "
                                 "their engine calls were closed.", ["route"], registry=registry)

    def watch(self, capacity: Capacity) -> None:
        """Read queue depth and admitted work from `capacity` at every scrape."""
        self.queued.set_function(lambda: capacity.queued)
        self.in_flight_sequences.set_function(lambda: capacity.sequences)
        self.in_flight_tokens.set_function(lambda: capacity.tokens)


class _MetricsMiddleware:
    """Counts generation requests by status and times them to their last byte (streams too)."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in _GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.monotonic()

        async def _send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, _send)
        finally:
            self.metrics.in_flight.dec()
            model = scope.get("state", {}).get("tandem_model", "unknown")
            self.metrics.requests.labels(scope["path"], model, str(status)).inc()
            self.metrics.latency.labels(scope["path"]).observe(time.monotonic() - t0)


# errors ---------------------------------------------------------------------
def _error(status: int, message: str, kind: str, *, param: str | None = None, **extra: Any) -> JSONResponse:
    """An OpenAI-shaped error reply, `{"error": {message, type, param, code}}`, that always serializes."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status, **extra}}
    return error_response(status, body)


def _refused_as_invalid(exc: EngineResponseError) -> bool:
    """Whether the engine refused a generation for what the client asked (a prompt longer than
    the context, ...): a 4xx about the request, not about an adapter it lacks (a server fault)."""
    return exc.status_code in (400, 413, 422) and "never been loaded" not in exc.engine_message


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ModelNotFound)
    async def _not_found(_: Request, exc: ModelNotFound) -> JSONResponse:
        return _error(404, str(exc), "model_not_found", param="model", known=exc.known)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        if isinstance(exc, EngineUnavailable):
            return _error(503, str(exc), "engine_unavailable")
        if isinstance(exc, EngineResponseError) and _refused_as_invalid(exc):
            return _error(400, f"invalid request, refused by the engine: {exc.engine_message}",
                          "invalid_request_error")
        return _error(502, str(exc), "engine_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, problems = invalid_request(exc)
        return _error(422, message, "invalid_request_error", param=param, detail=problems)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found", 422: "invalid_request_error"}.get(
            exc.status_code, "error")
        resp = _error(exc.status_code, str(exc.detail), kind)
        for name, value in (exc.headers or {}).items():
            resp.headers[name] = value
        return resp


# the gateway ----------------------------------------------------------------
class Gateway:
    """What the routes share: engine, routing table, tokenizer, registry, controller."""

    def __init__(self, settings: InferenceSettings, engine: EngineClient, table: RoutingTable, tokenizer: Any,
                 registry: Registry, controller: Controller | None, admission: Admission | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.settings = settings
        self.admission = admission
        self.capacity = Capacity.from_settings(settings.gateway)
        self.metrics = metrics if metrics is not None else GatewayMetrics(CollectorRegistry())
        self.metrics.watch(self.capacity)
        self.engine = engine
        self.table = table
        self.tokenizer = tokenizer
        self.registry = registry
        self.controller = controller
        self.vocab_size = len(tokenizer)

    # resolution -------------------------------------------------------------
    async def checkout(self, model: str) -> Lease:
        """Resolve `model` and hold its version; a run new to the table is looked up in Redis.

        Only registered runs exist: a name the registry lacks is 404 even if an event named it.

        In shared mode, while the GPU is lent to the trainer, this waits for it to come back.
        """
        if self.admission is not None:
            await self.admission.wait()
        run, _ = parse_model(model)
        try:
            return self.table.checkout(model)
        except ModelNotFound:
            if self.table.has_run(run):
                raise  # a known run: the error lists its loaded versions
        runs = await self.registry_runs()
        if run in runs:
            self.table.add_run(run)
            return self.table.checkout(model)
        known = [self.table.base_model, *runs]
        raise ModelNotFound(f"unknown model {model!r}: no run {run!r}; known: {self.table.base_model!r} "
                            f"(the base model) and runs {runs}", known=known)

    async def registry_runs(self) -> list[str]:
        """Registered runs (valid names only); the table's runs, all registered, while Redis is down."""
        try:
            return [r for r in await asyncio.to_thread(self.registry.list_runs) if RUN_NAME.match(r)]
        except (redis.RedisError, BackendUnavailable) as exc:
            log.warning("registry unreachable (%s); using the runs the routing table knows", exc)
            return self.table.runs()

    # prompts ----------------------------------------------------------------
    def chat_ids(self, body: ChatRequest) -> list[int]:
        messages = [m.as_template_input() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja errors of the template name the problem
            raise HTTPException(422, f"the chat template cannot render these messages: {exc}") from exc
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def completion_ids(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            return list(self.tokenizer(body.prompt)["input_ids"])
        bad = [t for t in body.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise HTTPException(
                422, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return list(body.prompt)

    def sampling(self, body: _Sampling, max_tokens: int | None) -> dict[str, Any]:
        limit = self.settings.engine.max_new_tokens_limit
        max_tokens = max_tokens or min(DEFAULT_MAX_TOKENS, limit)  # a default never exceeds the limit
        if max_tokens > limit:
            raise HTTPException(422, f"max_tokens {max_tokens} is above the limit {limit} "
                                     "(settings.engine.max_new_tokens_limit)")
        params: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
        }
        if body.stop:
            params["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
        if body.top_logprobs_num:  # a request field of /generate: the engine client lifts it out
            params["top_logprobs_num"] = body.top_logprobs_num
        return params

    # responses --------------------------------------------------------------
    async def serve(self, request: Request, kind: Literal["chat", "text"], body: _Sampling,
                    input_ids: list[int], params: dict[str, Any], logprobs: bool) -> Response:
        """Admit, resolve the version and generate; 429 beyond capacity, 499 when the client left."""
        try:
            return await _unless_client_leaves(request, self._serve(request, kind, body, input_ids, params, logprobs))
        except Overloaded as exc:
            self.metrics.refused.labels(exc.reason).inc()
            refusal = _error(429, str(exc), "rate_limit_exceeded", reason=exc.reason)
            refusal.headers["retry-after"] = str(exc.retry_after_s)
            return refusal
        except _ClientLeft:
            self.metrics.cancelled.labels(request.url.path).inc()
            log.info("client left %s before its response; its engine calls were closed", request.url.path)
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    async def _serve(self, request: Request, kind: Literal["chat", "text"], body: _Sampling,
                     input_ids: list[int], params: dict[str, Any], logprobs: bool) -> Response:
        permit = await self.capacity.acquire(body.n, body.n * params["max_new_tokens"])
        self.metrics.queue_wait.observe(permit.waited_s)
        try:
            lease = await self.checkout(body.model)
        except BaseException:
            permit.release()
            raise
        route = lease.route
        request.state.tandem_model = route.run or self.table.base_model
        headers = {"x-tandem-run": route.run or "", "x-tandem-version": str(route.version)}
        if body.stream:
            return await self._stream(lease, permit, kind, body, input_ids, params, logprobs, headers)
        try:
            results = await self._generate(input_ids, params, route.adapter, body.n)
        finally:
            lease.release()
            permit.release()
        outputs = []
        for r in results:
            out = Output()
            out.update(r)  # type: ignore[arg-type]
            outputs.append(out)
        choices = [self._choice(kind, i, out, logprobs) for i, out in enumerate(outputs)]
        payload = {**self._envelope(kind, route, stream=False), "choices": choices,
                   "usage": _usage(input_ids, outputs), "tandem": self._extension(route, input_ids, outputs)}
        return JSONResponse(payload, headers=headers)

    async def _generate(self, input_ids: list[int], params: dict[str, Any], adapter: str | None,
                        n: int) -> list[dict[str, Any]]:
        """The engine outputs of n samples, in order: one call, or n calls with gateway.fan_out_n."""
        if n == 1 or not self.settings.gateway.fan_out_n:
            return await self.engine.generate_n(input_ids, params, n, adapter)
        calls = [asyncio.ensure_future(self.engine.generate(input_ids, params, adapter)) for _ in range(n)]
        try:
            return list(await asyncio.gather(*calls))
        finally:  # one sample failed (or the client left): the others stop too
            for call in calls:
                call.cancel()
            await asyncio.shield(asyncio.gather(*calls, return_exceptions=True))

    def _engine_stream(self, input_ids: list[int], params: dict[str, Any], adapter: str | None,
                       n: int) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
        """The engine chunks of n samples as (sample index, chunk): one call, or n with gateway.fan_out_n."""
        if n > 1 and self.settings.gateway.fan_out_n:
            return _merge([self.engine.generate_stream(input_ids, params, adapter) for _ in range(n)])
        return _indexed(self.engine.generate_stream(input_ids, {**params, "n": n} if n > 1 else params, adapter), n)

    def _envelope(self, kind: str, route: Route, *, stream: bool, rid: str | None = None) -> dict[str, Any]:
        obj = {"chat": "chat.completion", "text": "text_completion"}[kind]
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        if stream and kind == "chat":
            obj += ".chunk"
        return {"id": rid or f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": route.name(self.table.base_model)}

    def _choice(self, kind: str, index: int, out: Output, logprobs: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": out.finish_reason or "stop"}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": out.text}
            choice["logprobs"] = {"content": self._chat_logprobs(out, 0)} if logprobs else None
        else:
            choice["text"] = out.text
            choice["logprobs"] = self._text_logprobs(out, 0) if logprobs else None
        return choice

    def _token_text(self, out: Output, i: int) -> str:
        text = out.token_texts[i] if i < len(out.token_texts) else None
        return text if text is not None else self.tokenizer.decode([out.token_ids[i]])

    def _alternatives(self, out: Output, i: int) -> list[tuple[str, float]]:
        """(token text, logprob) of the alternatives the engine listed at position `i`, best first."""
        tops = out.top_logprobs[i] if i < len(out.top_logprobs) else None
        return [(text if text is not None else self.tokenizer.decode([tid]), lp) for lp, tid, text in tops or ()]

    def _chat_logprobs(self, out: Output, start: int) -> list[dict[str, Any]]:
        entries = []
        for i in range(start, len(out.logprobs)):
            token = self._token_text(out, i)
            top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in self._alternatives(out, i)]
            entries.append({"token": token, "logprob": out.logprobs[i], "bytes": list(token.encode()),
                            "top_logprobs": top})
        return entries

    def _text_logprobs(self, out: Output, start: int) -> dict[str, Any]:
        tokens = [self._token_text(out, i) for i in range(start, len(out.logprobs))]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = None
        if any(t is not None for t in out.top_logprobs):  # asked for: OpenAI's {token: logprob} per position
            top = [by_text(self._alternatives(out, i)) for i in range(start, len(out.logprobs))]
        return {"tokens": tokens, "token_logprobs": out.logprobs[start:], "top_logprobs": top,
                "text_offset": offsets}

    @staticmethod
    def _extension(route: Route, input_ids: list[int], outputs: list[Output]) -> dict[str, Any]:
        return {"run": route.run, "version": route.version, "adapter": route.adapter,
                "prompt_token_ids": input_ids,
                "completion_token_ids": [o.token_ids for o in outputs],
                "completion_logprobs": [o.logprobs for o in outputs]}

    # streaming --------------------------------------------------------------
    async def _stream(self, lease: Lease, permit: Permit, kind: Literal["chat", "text"], body: _Sampling,
                      input_ids: list[int], params: dict[str, Any], logprobs: bool,
                      headers: dict[str, str]) -> Response:
        events = self._sse(lease, permit, kind, body.n, input_ids, params, logprobs)
        try:
            first = await events.__anext__()  # engine errors before the first token keep their status
        except BaseException:
            lease.release()
            permit.release()
            await events.aclose()
            raise
        route = _route_of(kind)
        return _EventStream(first, events, headers={**headers, "cache-control": "no-cache"},
                            on_client_left=lambda: self.metrics.cancelled.labels(route).inc())

    async def _sse(self, lease: Lease, permit: Permit, kind: Literal["chat", "text"], n: int, input_ids: list[int],
                   params: dict[str, Any], logprobs: bool) -> AsyncGenerator[str, None]:
        route = lease.route
        envelope = self._envelope(kind, route, stream=True)
        tag = {"run": route.run, "version": route.version}
        outputs = [Output(stops=params.get("stop") or ()) for _ in range(n)]
        finished = [False] * n

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return "data: " + json.dumps({**envelope, "choices": choices, "tandem": tag, **extra}) + "\n\n"

        merged = self._engine_stream(input_ids, params, route.adapter, n)
        try:
            started = False
            async for i, engine_chunk in merged:
                out = outputs[i]
                delta, start = out.update(engine_chunk)
                if not started and kind == "chat":
                    started = True
                    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None} for j in range(n)])
                started = True
                if delta or start < len(out.token_ids):
                    yield chunk([self._delta(kind, i, out, delta, start, logprobs)])
                if out.finish_reason and not finished[i]:
                    finished[i] = True
                    yield chunk([self._finish(kind, i, out.finish_reason)])
            for i, done in enumerate(finished):
                if not done:
                    yield chunk([self._finish(kind, i, "stop")])
            ext = self._extension(route, input_ids, outputs)
            yield chunk([], usage=_usage(input_ids, outputs), tandem=ext)
        except TandemError as exc:
            if not started:
                raise
            status = 503 if isinstance(exc, EngineUnavailable) else 502
            log.warning("stream on %s failed after it started: %s", route.name(self.table.base_model), exc)
            error = {"error": {"message": str(exc), "type": "engine_error", "code": status}}
            yield "data: " + json.dumps(error) + "\n\n"
        finally:
            lease.release()
            permit.release()
            await merged.aclose()
        yield "data: [DONE]\n\n"

    def _delta(self, kind: str, i: int, out: Output, text: str, start: int, logprobs: bool) -> dict[str, Any]:
        if kind == "chat":
            lp = {"content": self._chat_logprobs(out, start)} if logprobs else None
            return {"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        return {"index": i, "text": text, "logprobs": self._text_logprobs(out, start) if logprobs else None,
                "finish_reason": None}

    @staticmethod
    def _finish(kind: str, i: int, reason: str) -> dict[str, Any]:
        if kind == "chat":
            return {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
        return {"index": i, "text": "", "logprobs": None, "finish_reason": reason}


def _usage(input_ids: list[int], outputs: list[Output]) -> dict[str, Any]:
    completion = sum(len(o.token_ids) for o in outputs)
    # each of the n choices is its own engine request over the same prompt: report the most
    # any of them found in the prefix cache
    cached = max((o.cached_tokens for o in outputs), default=0)
    return {"prompt_tokens": len(input_ids), "completion_tokens": completion,
            "total_tokens": len(input_ids) + completion, "prompt_tokens_details": {"cached_tokens": cached}}


async def _indexed(
    stream: AsyncGenerator[dict[str, Any], None], n: int,
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """One engine stream of n samples as (sample index, chunk): each chunk names its `index`."""
    async with contextlib.aclosing(stream) as chunks:
        async for chunk in chunks:
            i = chunk.get("index", 0) if n > 1 else 0
            if not isinstance(i, int) or not 0 <= i < n:
                raise EngineResponseError(f"the engine streamed a chunk of sample {i!r}, expected 0..{n - 1}",
                                          status_code=200)
            yield i, chunk


async def _merge(
    streams: list[AsyncIterator[dict[str, Any]]],
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """Interleave several engine streams as (index, chunk); the first error ends all of them."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # Shielded: a second cancel (the stream's own, repeated by anyio while its client is gone)
        # would interrupt the pumps as they close their engine calls, leaving the engine generating.
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))


# clients that leave -----------------------------------------------------------
_T = TypeVar("_T")


class _ClientLeft(Exception):
    """The client closed its connection before its response started."""


async def _unless_client_leaves(request: Request, work: Coroutine[Any, Any, _T]) -> _T:
    """`work`'s result, unless the client leaves first: then `work` is cancelled (its engine calls
    closed, its version and room released) and _ClientLeft raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_left(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        gone.cancel()
        raise
    if task.done():
        gone.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientLeft


class _EventStream(StreamingResponse):
    """An SSE response that ends, and closes its engine calls, as soon as its client leaves.

    It listens for the disconnect whatever ASGI version the server speaks (under 2.4 Starlette
    would notice a client gone only when a chunk fails to send, so a stream waiting on the
    engine would go on generating for nobody), counts the client's leaving, and closes its
    event source however it ends, started or not, shielded from the cancellation that ended it.
    """

    def __init__(self, first: str, events: AsyncGenerator[str, None], *, headers: dict[str, str],
                 on_client_left: Callable[[], None]) -> None:
        async def body() -> AsyncIterator[str]:
            yield first
            async for item in events:
                yield item

        super().__init__(body(), media_type="text/event-stream", headers=headers)
        self._events = events
        self._on_client_left = on_client_left

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        finished = False
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    nonlocal finished
                    try:
                        await self.stream_response(send)
                        finished = True
                    except OSError:  # the client left mid-send
                        self._on_client_left()
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                if not finished:
                    self._on_client_left()
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()


def _route_of(kind: str) -> str:
    return _GENERATION_PATHS[0] if kind == "chat" else _GENERATION_PATHS[1]


# the app --------------------------------------------------------------------
def create_gateway_app(
    settings: InferenceSettings,
    *,
    engine: EngineClient,
    table: RoutingTable,
    tokenizer: Any,
    registry: Registry,
    controller: Controller | None = None,
    metrics: CollectorRegistry | None = None,
    admission: Admission | None = None,
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
) -> FastAPI:
    """The gateway app; its lifespan runs `controller` (if given) as a background task.

    `engine` wraps the process's httpx clients (generation and admin pools), which the caller
    owns and closes.
    `metrics` is the Prometheus registry /metrics serves (a fresh one if None); the
    controller's registry is served too when it is another one. `admission` holds requests
    while the GPU is lent out (shared mode); `background` coroutines (the GPU-sharing loop,
    the engine supervisor) run for the app's lifetime.
    """
    prom = metrics if metrics is not None else CollectorRegistry()
    gm = GatewayMetrics(prom)
    gw = Gateway(settings, engine, table, tokenizer, registry, controller, admission, gm)
    api_key = settings.gateway.api_key.get_secret_value() if settings.gateway.api_key else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if controller is not None:
            controller.start()
        tasks = [asyncio.create_task(job()) for job in background]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if controller is not None:
                await controller.stop()

    app = FastAPI(title="tandem gateway", lifespan=lifespan)
    app.state.gateway = gw
    _install_error_handlers(app)
    app.add_middleware(_MetricsMiddleware, metrics=gm)

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise HTTPException(401, "missing or wrong API key; send 'Authorization: Bearer KEY'",
                                headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(require_key)]

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        params = gw.sampling(body, body.max_completion_tokens or body.max_tokens)
        return await gw.serve(request, "chat", body, gw.chat_ids(body), params, body.logprobs)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        params = gw.sampling(body, body.max_tokens)
        prompt = gw.completion_ids(body)
        return await gw.serve(request, "text", body, prompt, params, body.logprobs is not None)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        registered = set(await gw.registry_runs())
        for run in registered:
            if not table.has_run(run):
                table.add_run(run)
        cards = [{"id": m, "object": "model", "created": 0, "owned_by": "tandem",
                  "root": settings.engine.model if m == table.base_model else None}
                 for m in table.known_models() if m == table.base_model or parse_model(m)[0] in registered]
        return {"object": "list", "data": cards}

    @app.get("/v1/runs/{run}", dependencies=auth)
    async def run_status(run: str) -> dict[str, Any]:
        runs = await gw.registry_runs()
        if run not in runs and not table.has_run(run):
            raise ModelNotFound(f"unknown run {run!r}; known runs: {sorted(set(runs) | set(table.runs()))}",
                                known=sorted(set(runs) | set(table.runs())))
        try:
            latest = await asyncio.to_thread(registry.latest_version, run)
        except (redis.RedisError, BackendUnavailable):
            latest = None
        return {"run": run, "serving_version": table.serving(run), "loaded_versions": table.loaded(run),
                "latest_version": latest,
                "in_flight": {str(v): table.in_flight(run, v) for v in [0, *table.loaded(run)]}}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        engine_ok = await engine.health()
        reconciled = controller is None or controller.reconciled
        body = {"status": "ready" if engine_ok and reconciled else "not ready",
                "engine": engine_ok, "reconciled": reconciled}
        return JSONResponse(body, status_code=200 if engine_ok and reconciled else 503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        text = generate_latest(prom)
        if controller is not None and controller.metrics.registry is not prom:
            text += generate_latest(controller.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app
