"""Health, what the engine serves, and its metrics: routes that anyone who reaches the engine may read.

`/health` is 503 until the model is loaded; `/health_generate` runs one token through the
model, so it is 503 while memory is released too.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem_inference.engines.transformers.dependencies import Engine, State, loaded_engine
from tandem_inference.engines.transformers.replies import error_body
from tandem_inference.engines.transformers.sampling import SamplingParams
from tandem_inference.errors import EngineError

router = APIRouter()


@router.get("/health")
async def health(state: State) -> JSONResponse:
    ok = state.engine is not None
    return JSONResponse({"status": "ok" if ok else "loading"}, status_code=200 if ok else 503)


@router.get("/health_generate")
async def health_generate(state: State) -> JSONResponse:
    try:
        engine = await loaded_engine(state)
        prompt = engine.model.encode("ok") or [0]
        await asyncio.to_thread(engine.generate, prompt, SamplingParams(max_new_tokens=1, temperature=0))
    except EngineError as exc:
        return JSONResponse(error_body(str(exc), 503), status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/server_info")
async def server_info(engine: Engine, state: State) -> dict[str, Any]:
    settings, model = state.settings, engine.model
    return {
        "engine": "transformers",
        "model_path": model.path,
        "tokenizer_path": model.path,
        "served_model_name": settings.served_model_name,
        "enable_lora": True,
        "max_lora_rank": settings.max_lora_rank,
        "max_loaded_adapters": settings.max_loaded_adapters,
        "max_loaded_loras": settings.max_loaded_adapters,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "context_length": model.max_context,
        "memory_released": engine.released,
        "loaded_adapters": engine.adapters,
        "version": version("tandem-inference"),
    }


@router.get("/model_info")
async def model_info(engine: Engine) -> dict[str, Any]:
    return {"model_path": engine.model.path, "tokenizer_path": engine.model.path, "is_generation": True}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
