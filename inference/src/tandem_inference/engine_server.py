"""The transformers engine's HTTP server: the subset of SGLang's API that tandem uses.

Request and response shapes follow SGLang (see sglang-api.md), so tandem's engine client,
controller and gateway talk to this server and to SGLang the same way: native `/generate`,
OpenAI chat/completions with `model = "<served>:<adapter>"`, adapter load/unload by name,
full-weight reloads (`/update_weights_from_disk`, see weights.py), memory release/resume,
health, server info and Prometheus metrics. Model work runs in worker
threads (the runtime serializes it), so the event loop stays responsive while it generates.

Logprobs (`output_token_logprobs`, OpenAI `logprobs`) are `log_softmax` of the raw logits, the
model's unscaled (temperature 1, unfiltered) distribution, of each token actually sampled: what
the trainer recomputes (see hf_engine). Top logprobs (`top_logprobs_num`, OpenAI `top_logprobs`,
or a count in completions' `logprobs`) list the likeliest tokens of that distribution. Bad input
is a 4xx naming the field, in SGLang's error shape with OpenAI's fields (bodies.py).

Run it with `python -m tandem_inference.engine_server` (or `tandem-engine`); settings come
from `TANDEM_ENGINE__*` (see tandem.settings.EngineSettings).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import Field
from starlette.exceptions import HTTPException

from tandem.settings import EngineSettings
from tandem_inference.bodies import (
    MAX_TOP_LOGPROBS,
    Body,
    ChatLogprobs,
    by_text,
    client_left,
    error_response,
    invalid_request,
    is_loopback,
)
from tandem_inference.errors import (
    AdapterLoadFailed,
    AdapterNotLoaded,
    EngineBusy,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    WeightsLoadFailed,
)
from tandem_inference.hf_engine import HFEngine, SamplingParams, Sequence
from tandem_inference.stops import sendable

log = logging.getLogger("tandem_inference.engine_server")

_STATUS = {
    InvalidRequest: 400,
    AdapterNotLoaded: 400,
    AdapterLoadFailed: 400,
    WeightsLoadFailed: 400,
    EngineUnavailable: 503,
    EngineBusy: 503,
}
_TAGS = {"weights", "kv_cache", "cuda_graph"}


class _Body(Body):
    """SGLang accepts many more fields: unknown ones are ignored. NaN, Infinity and lone
    surrogates are refused anywhere (see bodies.py)."""


class SamplingBody(_Body):
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    sampling_seed: int | None = None


class GenerateBody(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingBody = SamplingBody()
    return_logprob: bool = False
    logprob_start_len: int = -1  # accepted; only output-token logprobs are returned
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives per output token in meta_info.output_top_logprobs (with return_logprob)."""
    stream: bool = False
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None  # adapter NAME(s); None = base model


class _OpenAIBody(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False  # extension (vLLM's name): token ids in every choice

    @property
    def top_logprobs_num(self) -> int:
        """How many alternatives per token the reply lists (0: none)."""
        return 0


class ChatBody(ChatLogprobs, _OpenAIBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionBody(_OpenAIBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and SGLang's default for completions
    logprobs: bool | Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """true/false, or OpenAI's count: logprobs, and that many alternatives per token."""

    @property
    def top_logprobs_num(self) -> int:
        return 0 if isinstance(self.logprobs, bool) else self.logprobs or 0


class LoadBody(_Body):
    lora_name: str
    lora_path: str
    pinned: bool = False  # accepted; nothing is evicted here, so every adapter is pinned


class UnloadBody(_Body):
    lora_name: str


class WeightsBody(_Body):
    model_path: str
    load_format: str | None = None  # None, "auto" or "safetensors": what this engine reads
    flush_cache: bool = True  # accepted; no cross-request prefix cache to empty
    abort_all_requests: bool = False
    weight_version: str | None = None


class MemoryBody(_Body):
    tags: list[str] | None = None


class _Metrics:
    """Prometheus metrics in a registry of their own, so several apps can live in one process."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "tandem_engine_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter("tandem_engine_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("tandem_engine_generated_tokens", "Tokens generated", registry=r)
        self.adapter_load = Histogram(
            "tandem_engine_adapter_load_seconds",
            "Adapter load time in seconds",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.loaded_adapters = Gauge("tandem_engine_loaded_adapters", "Adapters loaded now", registry=r)
        self.weights_update = Histogram(
            "tandem_engine_weights_update_seconds",
            "Full-weight reload time (/update_weights_from_disk) in seconds",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )

    def count(self, seqs: list[Sequence]) -> None:
        self.generated_tokens.inc(sum(len(s.output_ids) for s in seqs))


def create_engine_app(settings: EngineSettings) -> FastAPI:
    """The engine as an ASGI app; its lifespan loads the model (in a worker thread)."""
    metrics = _Metrics()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = await asyncio.to_thread(
            HFEngine,
            settings.model,
            device=settings.device,
            max_lora_rank=settings.max_lora_rank,
            max_loaded_adapters=settings.max_loaded_adapters,
            allowed_targets=getattr(settings, "lora_target_modules", None),
        )
        yield
        app.state.engine = None

    app = FastAPI(title="tandem transformers engine", lifespan=lifespan)
    app.state.engine = None
    running: set[threading.Event] = set()  # cancel events of the requests running now

    def engine() -> HFEngine:
        if app.state.engine is None:
            raise EngineUnavailable("the model is not loaded yet; poll GET /health")
        return app.state.engine

    def admin(request: Request) -> None:
        """Admin routes load files and free memory: they need the admin key, or without one a
        client on loopback (the engine is private, but its network may not be)."""
        key = settings.admin_api_key.get_secret_value() if settings.admin_api_key is not None else ""
        if not key:
            peer = request.client.host if request.client else ""
            if not is_loopback(peer):
                raise HTTPException(
                    403, f"admin route called from {peer or 'an unknown address'}; without an admin key "
                    "(TANDEM_ENGINE__ADMIN_API_KEY) the engine answers admin routes on loopback only",
                )
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not secrets.compare_digest(given.encode(), key.encode()):
            raise HTTPException(
                401, "admin route: send the admin key as `Authorization: Bearer KEY` or `x-api-key: KEY`"
            )

    def sampling(max_new_tokens: int | None, **kw: Any) -> SamplingParams:
        if max_new_tokens is not None and max_new_tokens > settings.max_new_tokens_limit:
            raise InvalidRequest(
                f"max_new_tokens={max_new_tokens} exceeds the server limit "
                f"{settings.max_new_tokens_limit} (engine.max_new_tokens_limit)"
            )
        stop = kw.pop("stop")
        kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        kw["stop_token_ids"] = tuple(kw.pop("stop_token_ids") or ())
        kw = {k: v for k, v in kw.items() if v is not None}
        return SamplingParams(max_new_tokens=128 if max_new_tokens is None else max_new_tokens, **kw).check()

    def prepare(jobs: list[tuple[list[int], str | None]], params: SamplingParams) -> HFEngine:
        """Fail fast (HTTP 400/503 before any streaming starts) on what can be checked now."""
        eng = engine()
        if not jobs:
            raise InvalidRequest("empty input: no prompt given")
        for ids, adapter in jobs:
            eng.check_prompt(ids, params)
            eng.check_adapter(adapter)
        if eng.released:
            raise EngineUnavailable("engine memory is released; POST /resume_memory_occupation first")
        metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in jobs) * params.n)
        return eng

    async def run_all(
        jobs: list[tuple[list[int], str | None]], params: SamplingParams, request: Request | None = None
    ) -> list[list[Sequence]]:
        """Generate every job; when the client of `request` leaves, the rest is aborted (as SGLang does)."""
        eng = prepare(jobs, params)
        cancel = threading.Event()
        running.add(cancel)
        timer = asyncio.get_running_loop().call_later(settings.generate_timeout_s, cancel.set)
        watch = asyncio.ensure_future(_on_disconnect(request, cancel.set)) if request is not None else None
        try:
            results = await asyncio.to_thread(
                lambda: [eng.generate(ids, params, adapter, cancel=cancel) for ids, adapter in jobs]
            )
        finally:
            if watch is not None:
                watch.cancel()
            timer.cancel()
            cancel.set()
            running.discard(cancel)
        for seqs in results:
            metrics.count(seqs)
        return results

    def steps(
        jobs: list[tuple[list[int], str | None]], params: SamplingParams
    ) -> AsyncIterator[tuple[int, Sequence]]:
        """Check now (so bad input is an HTTP error), then stream (choice index, snapshot) pairs."""
        eng = prepare(jobs, params)

        async def advance() -> AsyncIterator[tuple[int, Sequence]]:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Any] = asyncio.Queue()
            cancel = threading.Event()
            done = object()

            def work() -> None:
                try:
                    for k, (ids, adapter) in enumerate(jobs):
                        sent = [0] * params.n

                        def on_step(seqs: list[Sequence], k: int = k, sent: list[int] = sent) -> None:
                            for j, s in enumerate(seqs):
                                if len(s.output_ids) > sent[j]:  # a new token (the last one ends it)
                                    sent[j] = len(s.output_ids)
                                    snap = dataclasses.replace(
                                        s,
                                        output_ids=list(s.output_ids),
                                        logprobs=list(s.logprobs),
                                        top_logprobs=list(s.top_logprobs),
                                    )
                                    loop.call_soon_threadsafe(queue.put_nowait, (k * params.n + j, snap))

                        metrics.count(eng.generate(ids, params, adapter, on_step=on_step, cancel=cancel))
                    loop.call_soon_threadsafe(queue.put_nowait, done)
                except Exception as exc:  # noqa: BLE001 - handed to the stream, reported as an error event
                    loop.call_soon_threadsafe(queue.put_nowait, exc)

            timer = loop.call_later(settings.generate_timeout_s, cancel.set)
            running.add(cancel)
            loop.run_in_executor(None, work)
            try:
                while (item := await queue.get()) is not done:
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:  # also when the client goes away: the worker stops at its next token
                timer.cancel()
                cancel.set()
                running.discard(cancel)

        return advance()

    def sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
            except Exception as exc:
                if not isinstance(exc, EngineError):
                    log.exception("stream failed")
                yield f"data: {json.dumps(_error_body(str(exc), _status(exc)))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    # -- native generation -------------------------------------------------------------------

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> Any:
        eng = engine()
        if body.text is not None and body.input_ids is not None:
            raise InvalidRequest("give either text or input_ids, not both")
        if body.text is None and body.input_ids is None:
            raise InvalidRequest("empty input: give text or input_ids")
        prompts: list[list[int]]
        if isinstance(body.text, list):
            batched, prompts = True, [eng.encode(t) for t in body.text]
        elif body.text is not None:
            batched, prompts = False, [eng.encode(body.text)]
        else:
            ids: list[Any] = body.input_ids or []
            batched = bool(ids) and isinstance(ids[0], list)
            prompts = ids if batched else [ids]
        loras = body.lora_path if isinstance(body.lora_path, list) else [body.lora_path] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequest(f"lora_path has {len(loras)} entries for {len(prompts)} prompts")
        params = sampling(
            **body.sampling_params.model_dump(exclude={"sampling_seed"}),
            seed=body.sampling_params.sampling_seed,
            top_logprobs=body.top_logprobs_num if body.return_logprob else 0,
        )
        jobs = list(zip(prompts, loras, strict=True))
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(jobs)
        multi = batched or params.n > 1

        def out(i: int, s: Sequence) -> dict[str, Any]:
            rid = rids[i // params.n] if i // params.n < len(rids) else None
            if rid is None:
                rid = uuid.uuid4().hex
            elif params.n > 1:
                rid = f"{rid}-{i % params.n}"
            return _native(
                eng,
                s,
                rid,
                body.return_logprob,
                body.top_logprobs_num,
                params.max_new_tokens,
                index=i if multi else None,
            )

        if body.stream:
            return sse(out(i, s) async for i, s in steps(jobs, params))
        results = [s for seqs in await run_all(jobs, params, request) for s in seqs]
        outs = [out(i, s) for i, s in enumerate(results)]
        return outs if multi else outs[0]

    # -- OpenAI routes ---------------------------------------------------------------------

    def openai_params(body: _OpenAIBody, max_tokens: int | None, prompt_len: int) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(1, min(settings.max_new_tokens_limit, engine().max_context - prompt_len))
        return sampling(
            max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            n=body.n,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            seed=body.seed,
            top_logprobs=body.top_logprobs_num,
        )

    def adapter_of(model: str | None) -> str | None:
        """SGLang's rule: `<served>:<adapter>` picks an adapter, anything else the base model."""
        return (model.split(":", 1)[1] or None) if model and ":" in model else None

    async def openai(
        body: _OpenAIBody, prompts: list[list[int]], params: SamplingParams, chat: bool, want_logprobs: bool
    ) -> Any:
        eng = engine()
        jobs = [(p, adapter_of(body.model)) for p in prompts]
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": body.model or settings.served_model_name,
        }
        usage_prompt = sum(len(p) for p in prompts)
        if body.stream:
            return sse(
                _openai_stream(
                    eng,
                    base,
                    steps(jobs, params),
                    len(jobs) * params.n,
                    chat,
                    want_logprobs,
                    params.top_logprobs,
                    params.stop,
                    usage_prompt if (body.stream_options or {}).get("include_usage") else None,
                )
            )
        seqs = [s for group in await run_all(jobs, params) for s in group]
        choices = []
        for i, s in enumerate(seqs):
            lp = _logprobs(eng, s, 0, chat, params.top_logprobs > 0) if want_logprobs else None
            choice: dict[str, Any] = {
                "index": i,
                "logprobs": lp,
                "finish_reason": s.finish_reason,
                "matched_stop": s.matched,
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": s.text}
            else:
                choice["text"] = s.text
            if body.return_token_ids:
                choice["token_ids"] = s.output_ids
            choices.append(choice)
        completion = sum(len(s.output_ids) for s in seqs)
        response = {
            **base,
            "object": "chat.completion" if chat else "text_completion",
            "choices": choices,
            "usage": {
                "prompt_tokens": usage_prompt,
                "completion_tokens": completion,
                "total_tokens": usage_prompt + completion,
            },
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = prompts if len(prompts) > 1 else prompts[0]
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> Any:
        eng = engine()
        prompt = eng.chat_prompt(_chat_messages(body.messages))
        params = openai_params(body, body.max_completion_tokens or body.max_tokens, len(prompt))
        return await openai(body, [prompt], params, chat=True, want_logprobs=body.logprobs)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Any:
        eng = engine()
        p = body.prompt
        if isinstance(p, str):
            prompts = [eng.encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [eng.encode(x) for x in p]  # type: ignore[arg-type]
        elif p and isinstance(p[0], list):
            prompts = list(p)  # type: ignore[arg-type]
        else:
            prompts = [list(p)]  # type: ignore[arg-type]
        params = openai_params(body, body.max_tokens, max((len(x) for x in prompts), default=0))
        want = body.logprobs is not None and body.logprobs is not False
        return await openai(body, prompts, params, chat=False, want_logprobs=want)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        eng = engine()
        card = {"object": "model", "created": created, "owned_by": "tandem", "max_model_len": eng.max_context}
        data = [{**card, "id": settings.served_model_name, "root": eng.model_path, "parent": None}]
        data += [
            {**card, "id": n, "root": p, "parent": settings.served_model_name}
            for n, p in eng.adapters.items()
        ]
        return {"object": "list", "data": data}

    # -- adapters, memory, health --------------------------------------------------------------

    def adapter_reply(eng: HFEngine, error: Exception | None = None) -> JSONResponse:
        loaded = eng.adapters
        metrics.loaded_adapters.set(len(loaded))
        body = {
            "success": error is None,
            "error_message": None if error is None else str(error),
            "loaded_adapters": loaded,
        }
        return JSONResponse(body, status_code=200 if error is None else _status(error))

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadBody, request: Request) -> JSONResponse:
        admin(request)
        eng = engine()
        try:
            _confine(body.lora_path, settings.adapter_roots, "lora_path", "engine.adapter_roots", AdapterLoadFailed)
            seconds = await asyncio.to_thread(eng.load_adapter, body.lora_name, body.lora_path)
        except EngineError as exc:
            log.warning("adapter_load_failed name=%s path=%s error=%s", body.lora_name, body.lora_path, exc)
            return adapter_reply(eng, exc)
        metrics.adapter_load.observe(seconds)
        return adapter_reply(eng)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadBody, request: Request) -> JSONResponse:
        admin(request)
        eng = engine()
        try:
            await asyncio.to_thread(eng.unload_adapter, body.lora_name, timeout_s=settings.unload_timeout_s)
        except EngineError as exc:
            return adapter_reply(eng, exc)
        return adapter_reply(eng)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: WeightsBody, request: Request) -> JSONResponse:
        """SGLang's full-weight refit: same architecture, new values, in place; 400 keeps the old."""
        admin(request)
        eng = engine()
        try:
            if body.load_format not in (None, "auto", "safetensors"):
                raise WeightsLoadFailed(
                    f"load_format={body.load_format!r} is not supported; this engine reads safetensors"
                )
            _confine(body.model_path, settings.weights_roots, "model_path", "engine.weights_roots", WeightsLoadFailed)
            if body.abort_all_requests:  # they end with finish_reason "abort" at their next token
                for cancel in list(running):
                    cancel.set()
            seconds = await asyncio.to_thread(
                eng.update_weights_from_disk, body.model_path, weight_version=body.weight_version
            )
        except EngineError as exc:
            log.warning("weights_update_failed path=%s error=%s", body.model_path, exc)
            reply = {"success": False, "message": str(exc), "num_paused_requests": 0}
            return JSONResponse(reply, status_code=_status(exc))
        metrics.weights_update.observe(seconds)
        reply = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        return JSONResponse(reply)

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> PlainTextResponse:
        admin(request)
        return PlainTextResponse("Cache flushed.\n")  # no cross-request prefix cache to empty

    async def memory(request: Request, body: MemoryBody | None, release: bool) -> dict[str, Any]:
        admin(request)
        eng = engine()
        unknown = sorted(set((body.tags if body else None) or ()) - _TAGS)
        if unknown:
            raise InvalidRequest(f"unknown memory tags {unknown}; use {sorted(_TAGS)} or null for all")
        if release:
            await asyncio.to_thread(eng.release, timeout_s=settings.generate_timeout_s)
        else:
            await asyncio.to_thread(eng.resume)
        return {
            "success": True,
            "message": "released" if release else "resumed",
            "memory_released": eng.released,
        }

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request, body: MemoryBody | None = None) -> dict[str, Any]:
        return await memory(request, body, release=True)

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request, body: MemoryBody | None = None) -> dict[str, Any]:
        return await memory(request, body, release=False)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = app.state.engine is not None
        return JSONResponse({"status": "ok" if ok else "loading"}, status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        try:
            eng = engine()
            await asyncio.to_thread(
                eng.generate, eng.encode("ok") or [0], SamplingParams(max_new_tokens=1, temperature=0)
            )
        except EngineError as exc:
            return JSONResponse(_error_body(str(exc), 503), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        eng = engine()
        from importlib.metadata import version

        return {
            "engine": "transformers",
            "model_path": eng.model_path,
            "tokenizer_path": eng.model_path,
            "served_model_name": settings.served_model_name,
            "enable_lora": True,
            "max_lora_rank": settings.max_lora_rank,
            "max_loaded_adapters": settings.max_loaded_adapters,
            "max_loaded_loras": settings.max_loaded_adapters,
            "device": str(eng.device),
            "dtype": str(eng.dtype).removeprefix("torch."),
            "context_length": eng.max_context,
            "memory_released": eng.released,
            "loaded_adapters": eng.adapters,
            "version": version("tandem-inference"),
        }

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        eng = engine()
        return {"model_path": eng.model_path, "tokenizer_path": eng.model_path, "is_generation": True}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- errors and request counting -------------------------------------------------------------

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable[[Request], Any]) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> JSONResponse:
        if _status(exc) >= 500:
            log.error("request_failed path=%s error=%s", request.url.path, exc)
        return error_response(_status(exc), _error_body(str(exc), _status(exc)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, _error_body(str(exc.detail), exc.status_code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, problems = invalid_request(exc)
        return error_response(422, {**_error_body(message, 422, param), "detail": problems})

    return app


async def _on_disconnect(request: Request, then: Callable[[], None]) -> None:
    """Call `then` once the client of `request` is gone."""
    await client_left(request)
    then()


def _confine(path: str, roots: list[Path] | None, field: str, setting: str, error: type[EngineError]) -> None:
    """Refuse `path` unless it, and every entry in it, resolves inside one of `roots`.

    Symlinks are followed before the check, so none leads out. `roots` None (EngineSettings
    built alone, as tests do) confines nothing; the service's settings always set them.
    """
    if roots is None:
        return
    resolved = [root.resolve() for root in roots]

    def inside(p: Path) -> bool:
        real = p.resolve()
        return any(real.is_relative_to(root) for root in resolved)

    where = f"{[str(r) for r in roots]} ({setting})"
    target = Path(path)
    try:
        if not target.is_absolute() or not inside(target):
            raise error(f"{field} {path!r} is outside the engine's roots {where}; load from inside them")
        if target.is_dir():
            for entry in target.iterdir():
                if not inside(entry):
                    raise error(f"{field} {path!r}: {entry.name} leads outside the engine's roots {where}")
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a symlink loop, no permission
        raise error(f"{field} {path!r} cannot be checked against the engine's roots {where}: {exc}; "
                    "give a readable path without NUL bytes or symlink loops") from exc


def _status(exc: Exception) -> int:
    return next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 500)


def _error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """SGLang's error shape, OpenAI's fields: `{"error": {message, type, param, code}}`."""
    kind = (
        "BadRequestError" if status < 500 else "ServiceUnavailableError" if status == 503 else "InternalError"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _native(
    eng: HFEngine, s: Sequence, rid: str, logprobs: bool, top: int, max_new: int, index: int | None
) -> dict[str, Any]:
    """One SGLang /generate output (also one stream event, with finish_reason None until the end)."""
    finish: dict[str, Any] | None = None
    if s.finish_reason == "length":
        finish = {"type": "length", "length": max_new, "matched": None}
    elif s.finish_reason:
        finish = {"type": s.finish_reason, "matched": s.matched}
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": len(s.output_ids),
        "cached_tokens": 0,
        "weight_version": eng.weight_version,
    }
    if logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.logprobs, s.output_ids, strict=False)]
        meta["input_token_logprobs"] = []
        if top > 0:
            meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in alts] for alts in s.top_logprobs]
    out: dict[str, Any] = {"text": s.text, "output_ids": s.output_ids, "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def _logprobs(eng: HFEngine, s: Sequence, start: int, chat: bool, top: bool) -> dict[str, Any]:
    """OpenAI logprobs of the tokens of `s` from `start` on; with `top`, their alternatives too."""
    tokens = [eng.decode([t]) for t in s.output_ids[start:]]
    lps = s.logprobs[start:]
    alternatives = [[(eng.decode([t]), lp) for lp, t in alts] for alts in s.top_logprobs[start:]]
    alternatives += [[] for _ in range(len(tokens) - len(alternatives))]
    if chat:
        return {
            "content": [
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": list(tok.encode()),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alts],
                }
                for tok, lp, alts in zip(tokens, lps, alternatives, strict=False)
            ]
        }
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    tops = [by_text(alts) for alts in alternatives] if top else None
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def _openai_stream(
    eng: HFEngine,
    base: dict[str, Any],
    events: AsyncIterator[tuple[int, Sequence]],
    n_choices: int,
    chat: bool,
    want_logprobs: bool,
    top: int,
    stops: tuple[str, ...],
    usage_prompt: int | None,
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI stream chunks: a role delta first (chat), then text deltas, then finish reasons."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    sent = [""] * n_choices
    tokens = [0] * n_choices
    completion = 0
    if chat:
        yield {
            **base,
            "object": kind,
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(n_choices)
            ],
        }
    async for i, s in events:
        lp = _logprobs(eng, s, tokens[i], chat, top > 0) if want_logprobs else None
        tokens[i] = len(s.output_ids)
        text = s.text if s.finish_reason else sendable(s.text, stops)
        delta = text[len(sent[i]) :] if text.startswith(sent[i]) else ""
        sent[i] += delta
        choice: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": s.finish_reason}
        if s.finish_reason:
            choice["matched_stop"] = s.matched
            completion += len(s.output_ids)
        if chat:
            choice["delta"] = {"content": delta} if delta or not s.finish_reason else {}
        else:
            choice["text"] = delta
        yield {**base, "object": kind, "choices": [choice]}
    if usage_prompt is not None:
        yield {
            **base,
            "object": kind,
            "choices": [],
            "usage": {
                "prompt_tokens": usage_prompt,
                "completion_tokens": completion,
                "total_tokens": usage_prompt + completion,
            },
        }


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with string contents (OpenAI's list-of-parts content is joined), checked."""
    if not messages:
        raise InvalidRequest("empty input: messages is empty")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise InvalidRequest(f"messages[{i}].role must be a string, got {role!r}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "role": role, "content": content or ""})
    return out


def main() -> None:
    """`tandem-engine`: parse settings, set up logging, then load the model and serve."""
    from tandem.settings import InferenceSettings

    settings = InferenceSettings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    log.info("engine_settings %s", json.dumps(settings.redacted()["engine"], default=str))
    import uvicorn
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    uvicorn.run(
        create_engine_app(settings.engine),
        host=settings.engine.host,
        port=settings.engine.port,
        log_level="info",
    )


if __name__ == "__main__":
    main()
