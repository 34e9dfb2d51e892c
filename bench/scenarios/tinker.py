"""Scenario 13, Tinker: a new policy to its first sampled token, through the real `tinker` SDK.

The suite's stack serves Tinker's API (the Tinker service in front of the gateway and the
trainer, as `tandem up` starts it). One LoRA training client on the stack's base model does, each
iteration, a forward_backward (cross_entropy on one short datum) pipelined with an optim_step, and
then, timed from the SDK's side:

    save               save_weights_and_get_sampling_client() until its future resolves: the step's
                       version is named, the service waits until the gateway serves it, and the SDK
                       builds the sampling client
    save -> token      the same, then sample(max_tokens=1) from that client until the token is back:
                       the first token the new weights sampled
    optim_step         for context: the optim_step future, from the call to its result (the
                       forward_backward before it is in flight when it is sent, so this holds both
                       trainer jobs, and the write of the new version)
    step -> token      optim_step sent -> that first token: the whole way from a gradient to a sample

The step publishes the new version as its future resolves, and the gateway's controller starts
loading it then: by the time the SDK calls save, part of the engine's load may be done, so `save`
is what a Tinker user waits for, not the load's whole cost (`step -> token` holds all of it).

Beside them: Miles' `save_weights_for_sampler`, 5.19 s a weight export on average (radixark/miles
PR #3261, Qwen3-30B-A3B on 32 x H200; a different model and cluster, the number its users see for
the same call), and the goal on a GPU (0.5B shape, split mode): save -> first token <= 200 ms p50.
On the CPU the goal is not checked (the trainer, the engine and the SDK share two cores); every
iteration sampling a token is.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from typing import Any

from bench.benchlib import Ctx, goal, md_table, summary

#: Miles' save_weights_for_sampler, seconds per export on average (radixark/miles PR #3261).
MILES_SAVE_S = 5.19
#: The GPU goal (0.5B shape, split mode): save_weights_and_get_sampling_client -> first token, p50 ms.
GPU_TARGET_MS = 200.0
TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]
"""The datum's token ids (the tiny tokenizer's 512 ids, which every shape of the suite keeps)."""
PROMPT = [5, 6, 7]


def api_key(ctx: Ctx) -> str:
    """`tml-` + the gateway's key where the stack has one, else any `tml-` key (the keyless local stack)."""
    key = os.environ.get("TANDEM_GATEWAY__API_KEY") or ctx.engine_env.get("TANDEM_GATEWAY__API_KEY") or "bench"
    return key if key.startswith("tml-") else f"tml-{key}"


def one_iteration(tc: Any, tt: Any, datum: Any, lr: float) -> dict[str, Any]:
    """One forward_backward + optim_step, then save -> sampling client -> one sampled token, timed (ms)."""
    fb = tc.forward_backward([datum], "cross_entropy")
    t0 = time.perf_counter()
    step = tc.optim_step(tt.AdamParams(learning_rate=lr))
    fb.result(timeout=600)
    step.result(timeout=600)
    t1 = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=600)
    t2 = time.perf_counter()
    got = sampler.sample(prompt=tt.ModelInput.from_ints(PROMPT), num_samples=1,
                         sampling_params=tt.SamplingParams(max_tokens=1, temperature=1.0)).result(timeout=600)
    t3 = time.perf_counter()
    tokens = len(got.sequences[0].tokens) if got.sequences else 0
    return {"optim_step_ms": (t1 - t0) * 1000, "save_ms": (t2 - t1) * 1000, "save_to_token_ms": (t3 - t1) * 1000,
            "step_to_token_ms": (t3 - t0) * 1000, "tokens": tokens}


def measure(ctx: Ctx, tinker_url: str, iterations: int) -> tuple[list[dict[str, Any]], str]:
    """A training client on the stack's base model, one warm-up iteration, then `iterations` timed ones."""
    import tinker
    from tinker import types as tt

    service = tinker.ServiceClient(base_url=tinker_url, api_key=api_key(ctx))
    try:
        rank = 8 if ctx.engine == "transformers" else 16
        tc = service.create_lora_training_client(base_model=ctx.model, rank=rank).result(timeout=600)
        datum = tt.Datum(model_input=tt.ModelInput.from_ints(TOKENS[:-1]),
                         loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
        # one-off costs (the engine wraps the base model on its first adapter) stay out of the count
        warm = one_iteration(tc, tt, datum, ctx.lr)
        ctx.progress(f"warm-up: save -> token {warm['save_to_token_ms']:.0f} ms (not counted)")
        rows = []
        for i in range(iterations):
            row = {"iteration": i + 1, **one_iteration(tc, tt, datum, ctx.lr)}
            rows.append(row)
            if (i + 1) % 10 == 0 or i + 1 == iterations:
                ctx.progress(f"{i + 1}/{iterations}: save {row['save_ms']:.0f} ms, save -> token "
                             f"{row['save_to_token_ms']:.0f} ms, optim_step {row['optim_step_ms']:.0f} ms")
        return rows, tc.model_id
    finally:
        service.close("success").result(timeout=60)
        with warnings.catch_warnings():  # tinker 0.38.0 leaves its event loop's sockets open after close()
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None
    if ctx.stack.tinker_url is None:
        raise RuntimeError("the stack serves no Tinker API: the `tinker` SDK is not installed in this interpreter "
                           "(pip install ./inference[tinker], or the dev lock)")
    iterations = 5 if ctx.quick else 30
    rows, model_id = measure(ctx, ctx.stack.tinker_url, iterations)
    stats = {key: summary([r[key] for r in rows]) for key in ("save_ms", "save_to_token_ms", "optim_step_ms",
                                                               "step_to_token_ms")}
    untokened = sum(1 for r in rows if r["tokens"] != 1)
    miles_ms = MILES_SAVE_S * 1000
    table = md_table(
        ["measure", "n", "p50 ms", "p95 ms", "max ms", "Miles' save_weights_for_sampler (mean)",
         "GPU goal (p50, 0.5B, split)"],
        [["save_weights_and_get_sampling_client", stats["save_ms"]["n"], stats["save_ms"]["p50"],
          stats["save_ms"]["p95"], stats["save_ms"]["max"], f"{MILES_SAVE_S} s", "–"],
         ["save → first sampled token", stats["save_to_token_ms"]["n"], stats["save_to_token_ms"]["p50"],
          stats["save_to_token_ms"]["p95"], stats["save_to_token_ms"]["max"], f"{MILES_SAVE_S} s",
          f"≤ {GPU_TARGET_MS:.0f} ms"],
         ["optim_step (context)", stats["optim_step_ms"]["n"], stats["optim_step_ms"]["p50"],
          stats["optim_step_ms"]["p95"], stats["optim_step_ms"]["max"], "–", "–"],
         ["optim_step sent → first sampled token (context)", stats["step_to_token_ms"]["n"],
          stats["step_to_token_ms"]["p50"], stats["step_to_token_ms"]["p95"], stats["step_to_token_ms"]["max"], "–",
          "–"]])
    table += (f"\n\n{iterations} iterations of forward_backward (cross_entropy, one {len(TOKENS)}-token datum) + "
              "optim_step, then save_weights_and_get_sampling_client() and sample(max_tokens=1) from it, through "
              f"the tinker SDK against the stack's Tinker service (model `{model_id}`); one warm-up iteration "
              f"first, not counted. save → first token p50 is {stats['save_to_token_ms']['p50'] / miles_ms:.3f} × "
              f"Miles' {MILES_SAVE_S} s (radixark/miles PR #3261: Qwen3-30B-A3B on 32 × H200, a different model "
              "and cluster; the same call as its users see it). The controller starts loading the version when the "
              "step publishes it, before save is called: the last row holds the load's whole cost.")
    if ctx.engine == "transformers":
        table += (" On the CPU the trainer, the engine, the gateway, the Tinker service and the SDK share the same "
                  f"cores: these numbers are not the GPU goal (≤ {GPU_TARGET_MS:.0f} ms p50), which is checked "
                  "only on a GPU.")
    goals = [goal("iterations whose sample did not return one token", float(untokened), 0.0)]
    if ctx.device.startswith("cuda"):
        goals.append(goal("save → first sampled token p50, ms", stats["save_to_token_ms"]["p50"], GPU_TARGET_MS))
    return {"name": "tinker", "title": "13. Tinker: a new policy to its first sampled token",
            "summary": {**stats, "iterations": iterations, "miles_save_s": MILES_SAVE_S,
                        "gpu_target_ms": GPU_TARGET_MS, "model_id": model_id},
            "rows": rows, "goals": goals, "table": table, "plots": []}
