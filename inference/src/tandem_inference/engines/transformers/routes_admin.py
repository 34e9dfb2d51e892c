"""SGLang's admin routes: adapters loaded and unloaded by name, full-weight reloads, memory release.

Every route here sits behind one dependency, `dependencies.admin`: the admin key, or without
one a client on loopback. Paths are confined to the engine's roots (see roots.py). A refused
adapter or checkpoint answers SGLang's `success: false` shape with a 4xx, and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from tandem_inference.engines.transformers.dependencies import Engine, ServerState, State, admin
from tandem_inference.engines.transformers.replies import status_of
from tandem_inference.engines.transformers.roots import confine
from tandem_inference.engines.transformers.runtime import HFEngine
from tandem_inference.engines.transformers.schemas import MEMORY_TAGS, LoadBody, MemoryBody, UnloadBody, WeightsBody
from tandem_inference.errors import AdapterLoadFailed, EngineError, InvalidRequest, WeightsLoadFailed

log = logging.getLogger(__name__)

router = APIRouter(dependencies=[Depends(admin)])


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadBody, engine: Engine, state: State) -> JSONResponse:
    roots = state.settings.adapter_roots
    try:
        confine(body.lora_path, roots, "lora_path", "engine.adapter_roots", AdapterLoadFailed)
        seconds = await asyncio.to_thread(engine.load_adapter, body.lora_name, body.lora_path)
    except EngineError as exc:
        log.warning("adapter_load_failed name=%s path=%s error=%s", body.lora_name, body.lora_path, exc)
        return _adapters_reply(state, engine, exc)
    state.metrics.adapter_load.observe(seconds)
    return _adapters_reply(state, engine)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadBody, engine: Engine, state: State) -> JSONResponse:
    try:
        await asyncio.to_thread(engine.unload_adapter, body.lora_name, timeout_s=state.settings.unload_timeout_s)
    except EngineError as exc:
        return _adapters_reply(state, engine, exc)
    return _adapters_reply(state, engine)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: WeightsBody, engine: Engine, state: State) -> JSONResponse:
    """SGLang's full-weight refit: same architecture, new values, in place; 400 keeps the old."""
    try:
        if body.load_format not in (None, "auto", "safetensors"):
            raise WeightsLoadFailed(f"load_format={body.load_format!r} is not supported; this engine reads safetensors")
        confine(body.model_path, state.settings.weights_roots, "model_path", "engine.weights_roots", WeightsLoadFailed)
        if body.abort_all_requests:  # they end with finish_reason "abort" at their next token
            state.generations.cancel_all()
        seconds = await asyncio.to_thread(
            engine.update_weights_from_disk, body.model_path, weight_version=body.weight_version
        )
    except EngineError as exc:
        log.warning("weights_update_failed path=%s error=%s", body.model_path, exc)
        reply = {"success": False, "message": str(exc), "num_paused_requests": 0}
        return JSONResponse(reply, status_code=status_of(exc))
    state.metrics.weights_update.observe(seconds)
    return JSONResponse({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})


@router.post("/flush_cache")
async def flush_cache() -> PlainTextResponse:
    return PlainTextResponse("Cache flushed.\n")  # no cross-request prefix cache to empty


@router.post("/release_memory_occupation")
async def release_memory(engine: Engine, state: State, body: MemoryBody | None = None) -> dict[str, Any]:
    _check_tags(body)
    await asyncio.to_thread(engine.release, timeout_s=state.settings.generate_timeout_s)
    return {"success": True, "message": "released", "memory_released": engine.released}


@router.post("/resume_memory_occupation")
async def resume_memory(engine: Engine, body: MemoryBody | None = None) -> dict[str, Any]:
    _check_tags(body)
    await asyncio.to_thread(engine.resume)
    return {"success": True, "message": "resumed", "memory_released": engine.released}


def _check_tags(body: MemoryBody | None) -> None:
    unknown = sorted(set((body.tags if body else None) or ()) - MEMORY_TAGS)
    if unknown:
        raise InvalidRequest(f"unknown memory tags {unknown}; use {sorted(MEMORY_TAGS)} or null for all")


def _adapters_reply(state: ServerState, engine: HFEngine, error: EngineError | None = None) -> JSONResponse:
    """SGLang's reply to a load or unload: success, the error and the adapters loaded now."""
    loaded = engine.adapters
    state.metrics.loaded_adapters.set(len(loaded))
    body = {
        "success": error is None,
        "error_message": None if error is None else str(error),
        "loaded_adapters": loaded,
    }
    return JSONResponse(body, status_code=200 if error is None else status_of(error))
