"""`asample` through tandem's gateway: the prompt's token ids to `/v1/completions` for run@vN (or
the base model), and its reply's token ids, logprobs and finish reasons back as Tinker's samples.

The gateway's own rules apply (admission, the engine's limits); what the engine cannot do is
refused here by name before anything is sent: `stop=[]` (no EOS), a seed,
top_k, prompt logprobs, top-k logprobs and the other extras of `SampleRequest`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
from tinker import types as tt

from tandem_inference.errors import TinkerInvalid, TinkerRefusal
from tandem_inference.tinker import wire

#: Fields of the SDK's SamplingParams under the gateway's names: a refusal of one names it as the SDK sent it.
SAMPLING_PARAMS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"})

#: SampleRequest's extras the engine cannot serve, with the value that means "not asked".
_EXTRAS: dict[str, Any] = {"prompt_logprobs": (None, False), "topk_prompt_logprobs": (0,),
                           "topk_sample_logprobs": (0,), "target_prompt_logprobs": (None,),
                           "prompt_alt_tokens_k": (0,), "prompt_logprobs_last_n": (None,),
                           "record_stability_info": (None, False)}


def prompt_tokens(prompt: tt.ModelInput) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, tt.EncodedTextChunk):
            raise TinkerInvalid(f"prompt.chunks.{j} is a {getattr(chunk, 'type', type(chunk).__name__)} chunk; tandem "
                             "samples from token chunks (EncodedTextChunk) only", param=f"prompt.chunks.{j}")
        tokens.extend(int(t) for t in chunk.tokens)
    if not tokens:
        raise TinkerInvalid("prompt has no tokens", param="prompt")
    return tokens


def completion_body(req: tt.SampleRequest, model: str) -> dict[str, Any]:
    """The gateway's /v1/completions body for a SampleRequest, or TinkerInvalid naming what cannot be served."""
    for name, neutral in _EXTRAS.items():
        if getattr(req, name, None) not in neutral:
            if name == "prompt_logprobs":
                raise TinkerInvalid(
                    "prompt logprobs (what SamplingClient.compute_logprobs and sample(include_prompt_logprobs=True) "
                    "ask for) are not supported by tandem's engines; a training client's forward(data, "
                    "'cross_entropy') returns the logprob of each target token of the same weights", param=name)
            raise TinkerInvalid(f"{name} is not supported by tandem's engines; leave it unset", param=name)
    p = req.sampling_params
    if p.seed is not None:
        raise TinkerInvalid("sampling_params.seed is not supported: tandem's engines do not promise a seeded sample; "
                         "leave it unset (temperature 0 is deterministic)", param="sampling_params.seed")
    if p.top_k not in (-1, 0):
        raise TinkerInvalid(f"sampling_params.top_k {p.top_k} is not supported; leave it -1 (top_p is)",
                         param="sampling_params.top_k")
    stop, stop_token_ids = _stops(p.stop)
    if not 1 <= req.num_samples <= 64:
        raise TinkerInvalid(f"num_samples {req.num_samples} is out of range; give 1 to 64", param="num_samples")
    body: dict[str, Any] = {"model": model, "prompt": prompt_tokens(req.prompt), "n": req.num_samples,
                            "temperature": p.temperature, "top_p": p.top_p, "logprobs": 0}
    if p.max_tokens is not None:
        body["max_tokens"] = p.max_tokens
    if stop:
        body["stop"] = stop
    if stop_token_ids:
        body["stop_token_ids"] = stop_token_ids
    return body


def _stops(stop: str | Sequence[str] | Sequence[int] | None) -> tuple[list[str], list[int]]:
    """Tinker's `stop` as the gateway's stop strings and stop token ids (the SDK sends either)."""
    if stop is None:
        return [], []
    if isinstance(stop, str):
        return [stop], []
    values = list(stop)
    if not values:
        raise TinkerInvalid("sampling_params.stop=[] (sampling past EOS) is not supported; leave stop unset",
                            param="sampling_params.stop")
    if all(isinstance(v, str) for v in values):
        return [str(v) for v in values], []
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if len(ids) == len(values):
        return [], ids
    raise TinkerInvalid("sampling_params.stop mixes strings and token ids; give one kind",
                        param="sampling_params.stop")


def sample(gateway: httpx.Client, body: dict[str, Any], timeout_s: float) -> bytes:
    """Generate through the gateway; the samples as a protobuf SampleResponse."""
    try:
        resp = gateway.post("/v1/completions", json=body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise TinkerRefusal(f"the gateway did not answer ({exc}); is it up?") from exc
    try:
        reply = resp.json()
    except ValueError:
        reply = {}
    if resp.status_code >= 400:
        message = (reply.get("error") or {}).get("message") if isinstance(reply, dict) else None
        error = TinkerInvalid if resp.status_code < 500 else TinkerRefusal
        param = (reply.get("error") or {}).get("param") if isinstance(reply, dict) else None
        if param == "stop_token_ids":  # the SDK's stop, sent as token ids
            param = "stop"
        if param in SAMPLING_PARAMS:  # the gateway's name of a field of the SDK's SamplingParams
            param = f"sampling_params.{param}"
        status = "" if resp.status_code < 500 else f" ({resp.status_code})"  # a 4xx is the caller's: this 422
        raise error(f"the gateway refused the sample{status}: {message or resp.text[:300]}", param=param)
    ext = reply.get("tandem") or {}
    ids, lps = ext.get("completion_token_ids") or [], ext.get("completion_logprobs") or []
    choices = sorted(reply.get("choices") or [], key=lambda c: c.get("index", 0))
    samples = [(ids[i], lps[i] if i < len(lps) else [], c.get("finish_reason") or "stop")
               for i, c in enumerate(choices) if i < len(ids)]
    return wire.sample_response(samples)
