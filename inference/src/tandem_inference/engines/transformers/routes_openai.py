"""OpenAI's routes: `/v1/chat/completions`, `/v1/completions` and `/v1/models`.

`model = "<served>:<adapter>"` runs on that adapter, any other model name on the base model
(SGLang's rule). Without `max_tokens`, a reply may fill the context, up to
engine.max_new_tokens_limit.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from tandem_inference.engines.transformers import openai_format
from tandem_inference.engines.transformers.dependencies import Engine, ServerState, State
from tandem_inference.engines.transformers.replies import sse
from tandem_inference.engines.transformers.runtime import HFEngine
from tandem_inference.engines.transformers.sampling import SamplingParams
from tandem_inference.engines.transformers.schemas import ChatBody, CompletionBody, OpenAIBody, sampling_params

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, engine: Engine, state: State) -> Any:
    prompt = engine.model.chat_prompt(openai_format.chat_messages(body.messages))
    params = _params(state, engine, body, body.max_completion_tokens or body.max_tokens, len(prompt))
    return await _complete(state, engine, body, [prompt], params, chat=True, want_logprobs=body.logprobs)


@router.post("/v1/completions")
async def completions(body: CompletionBody, engine: Engine, state: State) -> Any:
    p = body.prompt
    prompts: list[list[int]]
    if isinstance(p, str):
        prompts = [engine.model.encode(p)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [engine.model.encode(x) for x in p if isinstance(x, str)]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [x for x in p if isinstance(x, list)]
    else:
        prompts = [[x for x in p if isinstance(x, int)]]
    params = _params(state, engine, body, body.max_tokens, max((len(x) for x in prompts), default=0))
    want = body.logprobs is not None and body.logprobs is not False
    return await _complete(state, engine, body, prompts, params, chat=False, want_logprobs=want)


@router.get("/v1/models")
async def models(engine: Engine, state: State) -> dict[str, Any]:
    served = state.settings.served_model_name
    card = {"object": "model", "created": state.created, "owned_by": "tandem",
            "max_model_len": engine.model.max_context}
    data = [{**card, "id": served, "root": engine.model.path, "parent": None}]
    data += [{**card, "id": n, "root": p, "parent": served} for n, p in engine.adapters.items()]
    return {"object": "list", "data": data}


def _params(
    state: ServerState, engine: HFEngine, body: OpenAIBody, max_tokens: int | None, prompt_len: int
) -> SamplingParams:
    limit = state.settings.max_new_tokens_limit
    if max_tokens is None:
        max_tokens = max(1, min(limit, engine.model.max_context - prompt_len))
    return sampling_params(
        max_tokens,
        limit=limit,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        n=body.n,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        seed=body.seed,
        top_logprobs=body.alternatives_per_token,
    )


async def _complete(
    state: ServerState,
    engine: HFEngine,
    body: OpenAIBody,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    chat: bool,
    want_logprobs: bool,
) -> dict[str, Any] | StreamingResponse:
    jobs = [(p, body.adapter) for p in prompts]
    base = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body.model or state.settings.served_model_name,
    }
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return sse(
            openai_format.chunks(
                engine.model,
                base,
                state.generations.stream(engine, jobs, params),
                len(jobs) * params.n,
                chat,
                want_logprobs,
                params.top_logprobs,
                params.stop,
                sum(len(p) for p in prompts) if include_usage else None,
            )
        )
    seqs = [s for group in await state.generations.run_all(engine, jobs, params) for s in group]
    return openai_format.reply(
        engine.model,
        base,
        seqs,
        chat=chat,
        want_logprobs=want_logprobs,
        top=params.top_logprobs,
        prompts=prompts,
        token_ids=body.return_token_ids,
    )
