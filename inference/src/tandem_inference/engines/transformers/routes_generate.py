"""SGLang's native `/generate`: text or token ids (one prompt or a batch), an adapter per prompt.

One prompt with n = 1 answers one output; a batch or n > 1 answers a list with `index`.
Logprobs (`output_token_logprobs`) are of the raw distribution (see sampling.py); a stream
sends cumulative outputs, then `[DONE]`. When the client leaves, the rest is aborted.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request

from tandem_inference.engines.transformers.dependencies import Engine, State
from tandem_inference.engines.transformers.replies import sse
from tandem_inference.engines.transformers.runtime import HFEngine
from tandem_inference.engines.transformers.sampling import Sequence
from tandem_inference.engines.transformers.schemas import GenerateBody, sampling_params
from tandem_inference.errors import InvalidRequest

router = APIRouter()


@router.post("/generate")
async def generate(body: GenerateBody, request: Request, engine: Engine, state: State) -> Any:
    prompts, batched = _prompts(engine, body)
    loras = body.lora_path if isinstance(body.lora_path, list) else [body.lora_path] * len(prompts)
    if len(loras) != len(prompts):
        raise InvalidRequest(f"lora_path has {len(loras)} entries for {len(prompts)} prompts")
    s = body.sampling_params
    params = sampling_params(
        s.max_new_tokens,
        limit=state.settings.max_new_tokens_limit,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        n=s.n,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        seed=s.sampling_seed,
        top_logprobs=body.top_logprobs_num if body.return_logprob else 0,
    )
    jobs = list(zip(prompts, loras, strict=True))
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(jobs)
    multi = batched or params.n > 1

    def out(i: int, seq: Sequence) -> dict[str, Any]:
        rid = rids[i // params.n] if i // params.n < len(rids) else None
        if rid is None:
            rid = uuid.uuid4().hex
        elif params.n > 1:
            rid = f"{rid}-{i % params.n}"
        top = body.top_logprobs_num
        return output(engine, seq, rid, body.return_logprob, top, params.max_new_tokens, i if multi else None)

    if body.stream:
        return sse(out(i, seq) async for i, seq in state.generations.stream(engine, jobs, params))
    results = [seq for seqs in await state.generations.run_all(engine, jobs, params, request) for seq in seqs]
    outs = [out(i, seq) for i, seq in enumerate(results)]
    return outs if multi else outs[0]


def _prompts(engine: HFEngine, body: GenerateBody) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the body gave a batch."""
    if body.text is not None and body.input_ids is not None:
        raise InvalidRequest("give either text or input_ids, not both")
    if isinstance(body.text, list):
        return [engine.model.encode(t) for t in body.text], True
    if body.text is not None:
        return [engine.model.encode(body.text)], False
    if body.input_ids is None:
        raise InvalidRequest("empty input: give text or input_ids")
    ids = body.input_ids
    if ids and all(isinstance(x, list) for x in ids):
        return [x for x in ids if isinstance(x, list)], True
    return [[x for x in ids if isinstance(x, int)]], False


def output(
    engine: HFEngine, s: Sequence, rid: str, logprobs: bool, top: int, max_new: int, index: int | None
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
        "weight_version": engine.weight_version,
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
