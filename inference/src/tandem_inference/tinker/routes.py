"""The routes of Tinker's API under /api/v1/, as the `tinker` SDK calls them.

Bodies are parsed with the SDK's own types (`tinker.types`), so a body the SDK would not send is
refused with 422 naming the field. Redis and the gateway are reached with blocking clients, in
FastAPI's thread pool. Every route needs the API key when one is set (`X-API-Key`, which the SDK
sends, or `Authorization: Bearer`), except /api/v1/healthz.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from tinker import types as tt

from tandem_inference.errors import TinkerInvalid, TinkerNotFound
from tandem_inference.tinker import futures, sampling, wire
from tandem_inference.tinker.order import checked_seq
from tandem_inference.tinker.service import TinkerService
from tandem_inference.tinker.state import Future, Kind, new_id

M = TypeVar("M", bound=BaseModel)
#: A pending future's poll looks again after 10 ms, then 20, 40, ... up to 200 ms between looks, until
#: `tinker.poll_wait_s`: a job that ends within a few ms is answered within a few ms, and a long one
#: costs Redis five looks a second.
POLL_FIRST_S, POLL_LAST_S = 0.01, 0.2


def service(request: Request) -> TinkerService:
    svc: TinkerService = request.app.state.tinker
    return svc


def require_key(request: Request) -> None:
    key = service(request).settings.gateway.api_key
    if key is None:
        return
    secret = key.get_secret_value()
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    given = request.headers.get("x-api-key") or (bearer if scheme.lower() == "bearer" else "")
    if not any(secrets.compare_digest(given.encode(), k.encode()) for k in (secret, f"tml-{secret}")):
        raise HTTPException(401, "missing or wrong API key; pass api_key='tml-' + the gateway's key "
                            "(TANDEM_GATEWAY__API_KEY) to tinker.ServiceClient", headers={"WWW-Authenticate": "Bearer"})


api = APIRouter(prefix="/api/v1", dependencies=[Depends(require_key)])
open_api = APIRouter(prefix="/api/v1")


async def parse(request: Request, model: type[M]) -> M:
    raw = wire.loads(await request.body())
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise wire.invalid(exc, f"invalid {model.__name__}") from exc


def untyped(future: Future) -> dict[str, Any]:
    return {"request_id": future.request_id, "model_id": future.model_id}


Route = Callable[[Request], Awaitable[dict[str, Any]]]


def ordered(kind: Kind) -> Callable[[Route], Route]:
    """A training call's route: when it is refused (422, 404), its seq_id is used up all the same, so
    the model's next calls are not left waiting for a request that will never be ordered."""
    def wrap(route: Route) -> Route:
        @functools.wraps(route)
        async def handler(request: Request) -> dict[str, Any]:
            try:
                return await route(request)
            except (TinkerInvalid, TinkerNotFound) as exc:
                svc = service(request)
                ids = wire.request_ids(await request.body(), request.headers.get("content-type", ""),
                                       request.headers.get("content-encoding"), svc.settings.tinker.max_body_bytes)
                if ids is not None:
                    await run_in_threadpool(svc.skip, *ids, kind, str(exc))
                raise
        return handler
    return wrap


@open_api.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@api.post("/client/config")
async def client_config() -> dict[str, Any]:
    # the flags of a plain API-key server: no JWT exchange, no server-side custom losses, one poll per future
    return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
            "sample_join_sampling_session": False, "parallel_fwdbwd_chunks": True}


@api.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@api.post("/telemetry")
async def telemetry() -> dict[str, str]:
    return {"status": "accepted"}  # the SDK's telemetry is not kept


@api.post("/create_session")
async def create_session(request: Request) -> dict[str, Any]:
    req = await parse(request, tt.CreateSessionRequest)
    session_id = await run_in_threadpool(service(request).state.create_session, req.sdk_version)
    return {"type": "create_session", "session_id": session_id}


@api.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> dict[str, Any]:
    req = await parse(request, tt.SessionHeartbeatRequest)
    await run_in_threadpool(service(request).state.touch_session, req.session_id)
    return {"type": "session_heartbeat"}


@api.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> Response:
    """The SDK's close(): the session's heartbeat ends; its models, futures and checkpoints stay."""
    await run_in_threadpool(service(request).state.touch_session, session_id)
    return JSONResponse(None)


@api.get("/get_server_capabilities")
async def get_server_capabilities(request: Request) -> dict[str, Any]:
    card = await run_in_threadpool(service(request).card)
    names = dict.fromkeys([card.model, card.served_name])
    return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True} for n in names]}


@api.post("/create_model")
async def create_model(request: Request) -> dict[str, Any]:
    req = await parse(request, tt.CreateModelRequest)
    return untyped(await run_in_threadpool(service(request).create_model, req))


@api.post("/get_info")
async def get_info(request: Request) -> dict[str, Any]:
    req = await parse(request, tt.GetInfoRequest)
    return await run_in_threadpool(service(request).get_info, req.model_id)


@api.post("/forward_backward")
@ordered("forward_backward")
async def forward_backward(request: Request) -> dict[str, Any]:
    svc = service(request)
    body = wire.decompress(await request.body(), request.headers.get("content-encoding"),
                           svc.settings.tinker.max_body_bytes)
    if wire.PROTO in request.headers.get("content-type", ""):
        parsed = wire.parse_forward_backward(body)
    else:
        parsed = _json_forward_backward(body)
    return untyped(await run_in_threadpool(svc.forward_backward, *parsed))


def _json_forward_backward(body: bytes) -> tuple[str, int | None, str, dict[str, float], list[Any], bool]:
    """The JSON form of a forward_backward (what SDKs before protobuf sent)."""
    raw = wire.loads(body)
    if not isinstance(raw, dict):
        raise TinkerInvalid(f"the body is not a ForwardBackwardRequest, in JSON or protobuf (Content-Type: "
                            f"{wire.PROTO}): a JSON {type(raw).__name__}, not an object", param="body")
    fbi = raw.get("forward_backward_input")
    if not isinstance(fbi, dict):
        raise TinkerInvalid(f"forward_backward_input is {type(fbi).__name__}; send an object with data (a list of "
                            "Datum) and loss_fn", param="forward_backward_input")
    for field, kind in (("data", list), ("loss_fn_config", (dict, type(None)))):
        if not isinstance(fbi.get(field), kind):
            raise TinkerInvalid(f"forward_backward_input.{field} is {type(fbi.get(field)).__name__}; send "
                                f"{'a list of Datum' if field == 'data' else 'an object of numbers, or null'}",
                                param=f"forward_backward_input.{field}")
    try:
        loss_fn = wire.check_loss(str(fbi["loss_fn"]))  # first: an unsupported loss is named before its config
        datums = []
        for i, d in enumerate(fbi["data"]):
            if not isinstance(d, dict):
                raise TinkerInvalid(f"data.{i} is {type(d).__name__}; each datum is an object with model_input "
                                    "and loss_fn_inputs", param=f"data.{i}")
            tokens = [int(t) for j, c in enumerate(d["model_input"]["chunks"]) for t in _chunk_tokens(i, j, c)]
            inputs = {k: wire.json_tensor(f"data.{i}.loss_fn_inputs.{k}", v) for k, v in d.get("loss_fn_inputs", {}).items()}
            datums.append(wire.datum(i, tokens, inputs))
        config = {k: float(v) for k, v in (fbi.get("loss_fn_config") or {}).items()}
        seq = checked_seq(raw.get("seq_id"))  # here, not in the job: a bad one is a 422 naming it
        return (str(raw["model_id"]), seq, loss_fn, config, datums, bool(raw.get("forward_only", False)))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TinkerInvalid(f"the body is not a ForwardBackwardRequest, in JSON or protobuf (Content-Type: "
                         f"{wire.PROTO}): {type(exc).__name__}: {exc}", param="body") from exc


def _chunk_tokens(i: int, j: int, chunk: Any) -> list[Any]:
    if isinstance(chunk, dict) and "tokens" not in chunk and chunk.get("type", "encoded_text") != "encoded_text":
        raise TinkerInvalid(f"data.{i}.model_input.chunks.{j} is a {chunk['type']!r:.40} chunk; tandem trains on "
                            "token chunks (EncodedTextChunk) only", param=f"data.{i}.model_input")
    return list(chunk["tokens"])


@api.post("/optim_step")
@ordered("optim_step")
async def optim_step(request: Request) -> dict[str, Any]:
    req = await parse(request, tt.OptimStepRequest)
    return untyped(await run_in_threadpool(service(request).optim_step, req))


@api.post("/save_weights")
@ordered("save_weights")
async def save_weights(request: Request) -> dict[str, Any]:
    req = await parse(request, tt.SaveWeightsRequest)
    svc = service(request)
    return untyped(await run_in_threadpool(svc.save, req.model_id, req.seq_id, "save_weights", req.path))


@api.post("/save_weights_for_sampler")
@ordered("save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
    req = await parse(request, tt.SaveWeightsForSamplerRequest)
    if req.kind != "snapshot":
        raise TinkerInvalid(f"kind {req.kind!r} is not supported: every tandem version is an immutable snapshot "
                         "(running rollouts keep the version they started on)", param="kind")
    if req.path is None and req.sampling_session_seq_id is None:
        raise TinkerInvalid("give path (a checkpoint name) or sampling_session_seq_id", param="path")
    svc = service(request)
    return untyped(await run_in_threadpool(svc.save, req.model_id, req.seq_id, "save_weights_for_sampler",
                                           req.path, req.sampling_session_seq_id))


@api.post("/load_weights")
@ordered("load_weights")
async def load_weights(request: Request) -> dict[str, Any]:
    req = await parse(request, tt.LoadWeightsRequest)
    return untyped(await run_in_threadpool(service(request).load_weights, req))


@api.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict[str, Any]:
    req = await parse(request, tt.CreateSamplingSessionRequest)
    svc = service(request)
    await run_in_threadpool(svc.state.touch_session, req.session_id)
    session = await run_in_threadpool(svc.create_sampling_session, req.base_model, req.model_path)
    return {"type": "create_sampling_session", "sampling_session_id": session.sampling_session_id}


@api.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
    """A sampling session's base model and checkpoint: what the SDK asks before it samples from a
    client opened on a path (create_sampling_client(model_path=...), RestClient.get_sampler)."""
    session = await run_in_threadpool(service(request).sampling_session, sampler_id)
    return {"sampler_id": session.sampling_session_id, "base_model": session.base_model,
            "model_path": session.model_path}


@api.post("/asample")
async def asample(request: Request) -> dict[str, Any]:
    """Sample at once (the answer waits for the gateway) and store the result as a done future."""
    req = await parse(request, tt.SampleRequest)
    svc = service(request)
    session_id = req.sampling_session_id
    if session_id is not None:
        s = await run_in_threadpool(svc.sampling_session, session_id)
        run, version = s.run, s.version
    elif req.model_path is not None:
        run, version = await run_in_threadpool(svc.resolve_path, req.model_path)
    elif req.base_model is not None:
        await run_in_threadpool(svc._check_base, req.base_model)
        run, version = None, 0
    else:
        raise TinkerInvalid("give sampling_session_id, model_path or base_model", param="model_path")
    model = f"{run}@v{version}" if run and version else (run or (await run_in_threadpool(svc.card)).served_name)
    body = sampling.completion_body(req, model)
    proto = await run_in_threadpool(sampling.sample, svc.gateway, body, svc.settings.tinker.sample_timeout_s)
    future = Future(request_id=new_id("sample"), kind="sample", model_id=run, session_id=session_id,
                    proto=proto.hex())
    await run_in_threadpool(svc.state.put_future, future)
    if session_id is not None:
        await run_in_threadpool(svc.state.add_session_future, session_id, future.request_id)
    return {"request_id": future.request_id,
            "sample_sequence_ids": [f"{future.request_id}-{i}" for i in range(req.num_samples)]}


@api.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    req = await parse(request, tt.FutureRetrieveRequest)
    svc = service(request)
    deadline = time.monotonic() + svc.settings.tinker.poll_wait_s
    future = await run_in_threadpool(svc.state.future, req.request_id)
    tick = POLL_FIRST_S
    while True:
        done = await run_in_threadpool(futures.resolve, svc, future)
        if done is not None:
            break
        if time.monotonic() >= deadline:
            return JSONResponse(futures.try_again(req.request_id))
        await asyncio.sleep(tick)
        tick = min(2 * tick, POLL_LAST_S)
    data, proto = futures.answer(done)
    if proto is not None:
        return Response(proto, media_type=wire.PROTO)
    return JSONResponse(data)


@api.post("/retrieve_futures")
async def retrieve_futures(request: Request) -> dict[str, Any]:
    """A sampling session's finished requests (samples here are done when their future is made)."""
    req = await parse(request, tt.FuturesRetrieveRequest)
    svc = service(request)
    session_id = req.target.sampling_session_id
    await run_in_threadpool(svc.state.sampling_session, session_id)
    ids = await run_in_threadpool(svc.state.session_futures, session_id)
    foreign = [r for r in req.retrieved_request_ids if r not in ids]
    if foreign:
        raise TinkerNotFound(f"request ids {foreign[:5]} are not futures of sampling session {session_id!r}",
                       param="retrieved_request_ids")
    completions = [{"state": "finished", "request_id": r} for r in ids[req.prev_cursor:]]
    return {"completions": completions, "cursor": len(ids)}
