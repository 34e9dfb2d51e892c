"""The gateway's HTTP routes: generation (and episodes), runs (and deleting one), and operations
(health, readiness, metrics).

Generation and run routes need the API key when one is set (deleting a run too: the gateway has
one key); /health, /ready, /metrics and /metrics/engine never do (probes and scrapers reach them
from the private network), but /metrics names the runs only to a scrape with the key. The engine
listens where no scraper reaches it (its admin routes stay private), so /metrics/engine relays
its own metrics, as it names them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from tandem.errors import BackendUnavailable
from tandem.settings import EngineSettings
from tandem_inference.engines.base import METRICS_FORMAT
from tandem_inference.errors import EngineResponseError, EpisodeNotFound, ModelNotFound
from tandem_inference.gateway.error_replies import error_reply, for_clients
from tandem_inference.gateway.metrics import OpaqueRuns
from tandem_inference.gateway.schemas import EPISODE_ID, ChatRequest, CompletionRequest
from tandem_inference.gateway.service import Gateway

log = logging.getLogger(__name__)


def current_gateway(request: Request) -> Gateway:
    """The app's `Gateway` (set by create_gateway_app)."""
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(current_gateway)]


def has_key(request: Request, gw: GatewayDep) -> bool:
    """Whether the request carries the gateway's API key (True when none is set)."""
    if gw.api_key is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.encode(), gw.api_key.encode())


def require_key(request: Request, gw: GatewayDep) -> None:
    """Refuse a request without the gateway's API key (401), when one is set."""
    if not has_key(request, gw):
        raise HTTPException(401, "missing or wrong API key; send 'Authorization: Bearer KEY'",
                            headers={"WWW-Authenticate": "Bearer"})


generation = APIRouter(dependencies=[Depends(require_key)])
runs = APIRouter(dependencies=[Depends(require_key)])
operations = APIRouter()


@generation.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, gw: GatewayDep) -> Response:
    asked = body.max_completion_tokens or body.max_tokens
    sampling = gw.sampling(body, asked, "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    if body.episode is not None:
        turn = await gw.episode_turn(body, sampling.max_tokens)
        return await gw.serve(request, "chat", body, turn.input_ids, sampling, body.logprobs, episode=turn)
    ids = await gw.chat_ids(body)
    sampling = gw.fit_default(sampling, asked=asked, prompt_tokens=len(ids), prompt_param="messages",
                              param="max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    return await gw.serve(request, "chat", body, ids, sampling, body.logprobs)


EpisodeId = Annotated[str, PathParam(pattern=EPISODE_ID)]


@generation.get("/v1/episodes/{episode_id}")
async def get_episode(episode_id: EpisodeId, gw: GatewayDep) -> dict[str, Any]:
    """The episode's ids, loss mask, rollout logprobs and versions, as its last reply had them."""
    episode = await asyncio.to_thread(gw.episodes.get, episode_id)
    if episode is None:
        raise EpisodeNotFound(f"episode {episode_id!r} is unknown or has expired (gateway.episode_ttl_s = "
                              f"{gw.settings.gateway.episode_ttl_s:g} s)", param="episode_id")
    return episode.public()


@generation.delete("/v1/episodes/{episode_id}", status_code=204)
async def delete_episode(episode_id: EpisodeId, gw: GatewayDep) -> Response:
    """Forget the episode; deleting one that is gone is no error."""
    await asyncio.to_thread(gw.episodes.delete, episode_id)
    return Response(status_code=204)


@generation.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, gw: GatewayDep) -> Response:
    sampling = gw.sampling(body, body.max_tokens)
    prompt = await gw.completion_ids(body)
    sampling = gw.fit_default(sampling, asked=body.max_tokens, prompt_tokens=len(prompt))
    return await gw.serve(request, "text", body, prompt, sampling, body.logprobs is not None)


@runs.get("/v1/models")
async def models(gw: GatewayDep) -> dict[str, Any]:
    return {"object": "list", "data": await model_cards(gw)}


@runs.get("/v1/models/{model_id:path}")
async def model(model_id: str, gw: GatewayDep) -> dict[str, Any]:
    """One card of /v1/models (OpenAI's `models.retrieve`); a name it does not list is a 404 listing them."""
    cards = await model_cards(gw)
    for card in cards:
        if card["id"] == model_id:
            return card
    known = [str(c["id"]) for c in cards]
    raise ModelNotFound(f"unknown model {model_id!r}; known models: {known}", known=known)


async def model_cards(gw: Gateway) -> list[dict[str, Any]]:
    """The base model, every registered run and every registered version of one (`run@vN`: loaded
    now or on request), as OpenAI's model objects."""
    table = gw.table
    registered = await gw.registry_runs()
    for run in registered:
        if not table.has_run(run):
            table.add_run(run)
    try:
        versions = await asyncio.to_thread(gw.registry.versions_of, registered)
    except BackendUnavailable as exc:  # Redis down: what this replica routes to now
        log.warning("registry unreachable (%s); listing the versions the routing table holds", exc)
        versions = {run: table.loaded(run) for run in registered}
    names = [table.base_model]
    for run in sorted(registered):
        names += [run, *(f"{run}@v{v}" for v in sorted(set(versions.get(run, ())) | set(table.loaded(run))))]
    return [{"id": m, "object": "model", "created": 0, "owned_by": "tandem",
             "root": gw.settings.engine.model if m == table.base_model else None,
             **({"lora": lora_limits(gw.settings.engine)} if m == table.base_model else {})}
            for m in names]


def lora_limits(engine: EngineSettings) -> dict[str, Any]:
    """What adapters the engine takes, on the base model's card, so that a client refuses a run whose
    adapters would be refused only after their first training step: the largest rank, and the
    modules an adapter may target where the engine holds to a list (SGLang's --lora-target-modules
    and the transformers engine; vLLM takes any module)."""
    limits: dict[str, Any] = {"max_rank": engine.max_lora_rank}
    if engine.kind != "vllm":
        limits["target_modules"] = list(engine.lora_target_modules)
    return limits


@runs.get("/v1/runs/{run}")
async def run_status(run: str, gw: GatewayDep) -> dict[str, Any]:
    table = gw.table
    registered = await gw.registry_runs()
    if run not in registered and not table.has_run(run):
        known = sorted(set(registered) | set(table.runs()))
        raise ModelNotFound(f"unknown run {run!r}; known runs: {known}", known=known)
    return {"run": run, "serving_version": table.serving(run), "loaded_versions": table.loaded(run),
            "latest_version": await gw.latest_version(run),
            "in_flight": {str(v): table.in_flight(run, v) for v in [0, *table.loaded(run)]}}


@runs.delete("/v1/runs/{run}")
async def delete_run(run: str, gw: GatewayDep) -> Response:
    """Delete the run (tandem.deletion): 200 with what was removed, 404 for a run that is not
    registered (deleted already), 409 naming the job while one of it runs, 503 while Redis is away."""
    try:
        deletion = await gw.delete_run(run)
    except BackendUnavailable as exc:
        return error_reply(503, f"run {run!r} was not deleted: {exc}", "backend_unavailable")
    return JSONResponse(deletion.model_dump())


@operations.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@operations.get("/ready")
async def ready(gw: GatewayDep) -> JSONResponse:
    engine_ok = await gw.engine.health()
    reconciled = gw.controller is None or gw.controller.reconciled
    behind = {} if gw.controller is None else dict(gw.controller.agreement.behind)
    ok = engine_ok and reconciled and not behind
    body = {"status": "ready" if ok else "not ready", "engine": engine_ok, "reconciled": reconciled,
            "in_rotation": not behind, "behind": behind}
    return JSONResponse(body, status_code=200 if ok else 503)


@operations.get("/metrics")
async def metrics(request: Request, gw: GatewayDep) -> Response:
    """The gateway's and the controller's metrics. With an API key set, the runs' names go only to a
    scrape that sends the key (or to any, with `gateway.metrics_run_names`); others see them opaque:
    the port may be published, and the runs are listed to key holders only."""
    registries = [gw.metrics.registry]
    if gw.controller is not None and gw.controller.metrics.registry is not gw.metrics.registry:
        registries.append(gw.controller.metrics.registry)
    shown: list[Collector] = list(registries)
    if gw.api_key is not None and not gw.settings.gateway.metrics_run_names and not has_key(request, gw):
        shown = [OpaqueRuns(r, gw.api_key, keep=(gw.table.base_model, "unknown")) for r in registries]
    return Response(b"".join(generate_latest(c) for c in shown), media_type=CONTENT_TYPE_LATEST)


@operations.get("/metrics/engine")
async def engine_metrics(gw: GatewayDep) -> Response:
    """The replica's engine's own metrics, as the engine names them, relayed unread.

    An engine out of reach is a 503 (the error handlers'); one that answers an error, or too much,
    a 502 whatever its status, as no scrape asks for anything the engine could refuse.
    """
    try:
        text = await gw.engine.metrics()
    except EngineResponseError as exc:
        log.warning("engine metrics not relayed: %s", exc)
        return error_reply(502, for_clients(exc), "engine_error")
    return Response(text, media_type=METRICS_FORMAT)
