"""The decode loop: n samples of one prompt as one batch, with a KV cache, until each one stops.

The prompt is prefilled once and its cache shared by the n rows; each step samples one token
per row (`sampling.sample`), then ends the rows that hit an eos or stop token, a stop string,
`max_new_tokens` or a cancel, and drops them from the batch and the cache. The caller holds the
model lock with the adapter activated. torch and transformers are imported inside functions.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from tandem_inference.engines.transformers.model import Model
from tandem_inference.engines.transformers.sampling import SamplingParams, Sequence, sample
from tandem_inference.errors import EngineError
from tandem_inference.stops import first_stop

OnStep = Callable[[list[Sequence]], None]
"""Called with every sequence after each decode step (their text kept current)."""


class Cancel(Protocol):
    """What ends a generation early: a `threading.Event`, or several (see coalescing)."""

    def is_set(self) -> bool: ...


def decode(
    model: Model, prompt_ids: list[int], params: SamplingParams, on_step: OnStep | None, cancel: Cancel | None
) -> list[Sequence]:
    """`params.n` samples of `prompt_ids`; torch's failures become EngineError."""
    import torch

    seqs = [Sequence(prompt_tokens=len(prompt_ids)) for _ in range(params.n)]
    try:
        with torch.inference_mode():
            _loop(model, prompt_ids, params, seqs, on_step, cancel)
    except EngineError:
        raise
    except Exception as exc:  # torch: NaN probabilities, out of memory; never leave twins waiting
        raise EngineError(f"generation failed on {model.device}: {type(exc).__name__}: {exc}") from exc
    return seqs


def _loop(
    model: Model,
    prompt_ids: list[int],
    p: SamplingParams,
    seqs: list[Sequence],
    on_step: OnStep | None,
    cancel: Cancel | None,
) -> None:
    import torch
    from transformers import DynamicCache

    hf = model.hf
    gen = torch.Generator(device=model.device)
    gen.manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else model.eos_ids)
    want_text = bool(p.stop) or on_step is not None
    cache = DynamicCache(config=hf.config)
    cache_kw = {_cache_keyword(type(hf)): cache}
    ids = torch.tensor([prompt_ids], device=model.device)
    logits = hf(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kw).logits[:, -1]
    if p.n > 1:  # prefill once, then n rows share the prompt's cache
        cache.batch_repeat_interleave(p.n)
        logits = logits.expand(p.n, -1)
    rows = list(range(p.n))  # which sequence each batch row carries
    for step in range(p.max_new_tokens):
        tokens, logprobs, tops = sample(logits, p, gen)
        keep = []
        for row, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=False)):
            seq = seqs[rows[row]]
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            if tops is not None:
                seq.top_logprobs.append(list(zip(tops[0][row], tops[1][row], strict=True)))
            if want_text:
                seq.text = model.decode(seq.output_ids)
            if token in stop_ids:
                seq.finish_reason, seq.matched = "stop", token
            elif p.stop and (hit := first_stop(seq.text, p.stop)) is not None:
                seq.text = seq.text[: hit[0]]
                seq.finish_reason, seq.matched = "stop", hit[1]
            elif step == p.max_new_tokens - 1:
                seq.finish_reason = "length"
            elif cancel is not None and cancel.is_set():
                seq.finish_reason = "abort"
            else:
                keep.append(row)
        if on_step is not None:
            on_step(seqs)
        if not keep:
            break
        if len(keep) < len(rows):  # drop finished rows from the batch and the cache
            index = torch.tensor(keep, device=model.device)
            cache.batch_select_indices(index)
            tokens = tokens[index]
            rows = [rows[r] for r in keep]
        logits = hf(input_ids=tokens[:, None], use_cache=True, **cache_kw).logits[:, -1]
    for seq in seqs:
        if not isinstance(seq.matched, str):  # text cut at a stop string stays cut
            seq.text = model.decode(seq.output_ids)


def _cache_keyword(model_class: type[Any]) -> str:
    """The forward keyword of the KV cache: `cache` from transformers 5.24, `past_key_values` before
    (5.24 still takes the old name, with a FutureWarning, until 5.40). Read once per generation."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
