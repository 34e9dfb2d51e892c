"""Scenario 9, rollout/trainer agreement: the trainer's logprobs of the tokens the engine sampled.

A fresh version is trained on the stack; completions are sampled through the gateway at
temperatures 0.3, 0.7 and 1.0, with and without top_p 0.9; the trainer's backend (its own
interpreter, `python -m tandem_trainer.logprob_check`) recomputes every completion token's
logprob on the same version at the sample's temperature: the stack's own backend, or each of
`--agreement-backends peft,unsloth` in turn on the same samples (the GPU trainer's two). Per token: mean and max |Δ logprob|,
the share above 0.1, and the first epoch's mean importance ratio (1 when engine and trainer
agree). A control row reads the T = 0.7 samples as the unscaled model would (the other logprob
convention): what a convention mismatch looks like. A wrong LoRA kernel or a mixed-batch bug
shows up as a large max and a share above 0.1.

Goals: on the CPU (float32 on both sides) no token over 0.1 nats at any setting; on GPUs
(bfloat16) the rows at T >= 0.7 with top_p 1 within `BF16_AGREEMENT`, the bound the GPU test
holds the engines to (tests/integration/test_engine_batches.py). bfloat16's noise is multiplied
by how sharp the model's logits are: a random model of initializer_range 0.1 (what the GPU
learning checks use, so that LoRA can move it) is far too sharp for any bound, so the scenario
records the model's initializer_range and on GPUs needs a well-conditioned one (0.02, a real
model's) to be held to the bound.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from bench.benchlib import Ctx, goal, md_table, new_version, plt, save_figure
from tandem.adapters import AdapterStore
from tandem.logprobs import OUTLIER, Mismatch
from tandem.trajectories import Sample

BF16_AGREEMENT = {"mean_abs": 0.03, "max_abs": 0.25, "over_outlier": 0.02}
"""Engine against trainer in bfloat16 at T >= 0.7 and top_p 1, per token |Δ logprob|: bounds on the
mean, the maximum and the share above 0.1 nats. Measured on H100s over 26 such rows of 192 tokens
(SGLang 0.5.23 four runs, vLLM 0.33.0 two; a random 0.5B of initializer_range 0.02): mean <= 0.018,
max <= 0.102, share <= 0.5 % (one token). A logprob convention off by the temperature gives a share
of 68-77 % and a max above 1 nat, and a token decoded under the wrong adapter is off by more than a
nat too. (vLLM renormalises top_p < 1 logprobs over the nucleus: those rows are reported, not held.)"""
WELL_CONDITIONED = 0.05
"""The largest initializer_range of a random model whose bfloat16 logprobs the bound holds for."""

PROMPTS = ["Count from 3 to 9.", "Write some numbers.", "What is 12 plus 30?", "Name three colours."]
SETTINGS = [(t, p) for t in (0.3, 0.7, 1.0) for p in (1.0, 0.9)]


def trainer_env(ctx: Ctx, backend: str = "") -> dict[str, str]:
    """The trainer's environment as the stack has it; `backend` (peft, unsloth) overrides its backend."""
    env = {**os.environ, **ctx.engine_env, "HF_HUB_OFFLINE": "1"}
    if backend:
        env["TANDEM_BACKEND__KIND"] = backend
    if ctx.engine != "transformers":  # the trainer's GPU (shared mode: the engine's)
        gpus = env["TANDEM_GPUS__TRAINER"] if env.get("TANDEM_GPUS__MODE") == "split" else env["TANDEM_GPUS__INFERENCE"]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in json.loads(gpus)[:1])
    return env


def trainer_logprobs(ctx: Ctx, spec_json: str, version: int, version_dir: Path,
                     samples: list[dict[str, Any]], backend: str = "") -> tuple[list[list[float]], str]:
    """The trainer's logprob of every completion token of `samples`, each at its own temperature, and
    the backend that computed them (peft, unsloth): `backend`, else the one the stack's trainer uses."""
    work = ctx.out / "agreement"
    work.mkdir(exist_ok=True)
    (work / "spec.json").write_text(spec_json)
    (work / "samples.json").write_text(json.dumps(samples))
    out = work / f"trainer-{backend or 'stack'}.json"
    argv = [ctx.trainer_python, "-m", "tandem_trainer.logprob_check", "--spec", str(work / "spec.json"),
            "--version", str(version), "--version-dir", str(version_dir), "--samples", str(work / "samples.json"),
            "--out", str(out)]
    subprocess.run(argv, check=True, env=trainer_env(ctx, backend), timeout=900)
    body = json.loads(out.read_text())
    return body["trainer"], str(body.get("backend", "")).removesuffix("Backend").lower()


def sample(completion: Any) -> dict[str, Any]:
    """A completion as the trainer's samples have it (no text, no finish reason)."""
    fields: dict[str, Any] = completion.model_dump(include=set(Sample.model_fields))
    return fields


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None and ctx.client is not None
    n, max_tokens = (4, 16) if ctx.quick else (8, 48)
    run = ctx.client.run(ctx.run_name)
    version = new_version(run)
    version_dir = AdapterStore(ctx.store_root).version_dir(run.name, version)
    spec_json = run.spec.model_dump_json()
    sampled: dict[tuple[float, float], list[Any]] = {}
    for temperature, top_p in SETTINGS:
        comps = []
        for prompt in PROMPTS[: 2 if ctx.quick else 4]:
            comps += run.chat([{"role": "user", "content": prompt}], n=n, max_tokens=max_tokens,
                              temperature=temperature, top_p=top_p, version=version)
        sampled[temperature, top_p] = comps
    flat = [c for comps in sampled.values() for c in comps]
    ctx.progress(f"v{version}: {len(flat)} completions sampled; the trainer recomputes them")
    control_samples = sampled[0.7, 1.0]
    rows: list[dict[str, Any]] = []
    for kind in ctx.agreement_backends or ("",):  # "": the stack's own trainer backend
        # one trainer process for both (its backend loads once): the control is the T = 0.7 samples
        # again, each marked as sampled at T = 1 (the unscaled model)
        both, backend = trainer_logprobs(
            ctx, spec_json, version, version_dir,
            [sample(c) for c in flat] + [{**sample(c), "temperature": 1.0} for c in control_samples], kind)
        trainer, control = both[: len(flat)], both[len(flat):]
        at = 0
        for (temperature, top_p), comps in sampled.items():
            m = Mismatch.of([c.rollout_logprobs for c in comps], trainer[at: at + len(comps)])
            at += len(comps)
            rows.append({"backend": backend, "temperature": temperature, "top_p": top_p, **vars(m)})
            ctx.progress(f"{backend} T={temperature} top_p={top_p}: {m.tokens} tokens, mean |Δ| {m.mean_abs:.2e}, "
                         f"max {m.max_abs:.2e}, ratio {m.ratio_mean:.4f}")
        other = Mismatch.of([c.rollout_logprobs for c in control_samples], control)
        rows.append({"backend": backend, "temperature": 0.7, "top_p": 1.0, "control": "read as the unscaled model",
                     **vars(other)})
    worst = max(r["over_outlier"] for r in rows if "control" not in r)
    init = initializer_range(ctx.model)
    goals = held_to(ctx, rows, init)
    table = md_table(
        ["trainer backend", "temperature", "top_p", "tokens", "mean |Δ logprob|", "max |Δ logprob|",
         f"share > {OUTLIER}", "ratio mean"],
        [[r["backend"], f"{r['temperature']}" + (" (control: unscaled)" if "control" in r else ""), r["top_p"],
          r["tokens"], f"{r['mean_abs']:.2e}", f"{r['max_abs']:.2e}", f"{r['over_outlier']:.4f}",
          f"{r['ratio_mean']:.5f}"]
         for r in rows])
    table += (f"\n\nVersion {version}; {n} samples of each prompt, up to {max_tokens} tokens. The control row is the "
              "same T = 0.7 tokens recomputed without the temperature: a convention mismatch. The model's "
              f"initializer_range: {init if init is not None else 'not recorded (not a random model of tandem)'}.")
    if ctx.device != "cpu" and not goals:
        table += (f" At more than {WELL_CONDITIONED} a random model's logits are so sharp that bfloat16's noise "
                  "alone moves logprobs by tenths of a nat: the rows show that noise, and no goal is held "
                  "(`bench/gpu/gpu_proof.sh PART=compare` runs on a model of 0.02).")
    plot_name = "agreement.png"
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7, 3))
    labels = [(f"{r['backend']}\n" if len({x['backend'] for x in rows}) > 1 else "")
              + f"T={r['temperature']}\np={r['top_p']}" + ("\n(control)" if "control" in r else "") for r in rows]
    ax.bar(labels, [max(r["max_abs"], 1e-9) for r in rows], color=["#c44e52" if "control" in r else "#4c72b0"
                                                                   for r in rows])
    ax.set_yscale("log")
    ax.axhline(OUTLIER, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("max |Δ logprob| per token")
    ax.set_title(f"Rollout vs trainer logprobs ({ctx.engine})")
    save_figure(fig, ctx.out / plot_name)
    return {"name": "agreement", "title": "9. Rollout/trainer agreement",
            "summary": {"version": version, "worst_share_over_outlier": worst, "initializer_range": init},
            "rows": rows, "goals": goals,
            "table": table, "plots": [plot_name]}


def initializer_range(model: str) -> float | None:
    """The initializer_range in the model's config.json (tandem's random models record it), or None."""
    try:
        value = json.loads((Path(model) / "config.json").read_text()).get("initializer_range")
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, int | float) else None


def held_to(ctx: Ctx, rows: list[dict[str, Any]], init: float | None) -> list[dict[str, Any]]:
    """The scenario's goals: float32 (CPU) no outlier at any setting; bfloat16 (GPUs) the T >= 0.7,
    top_p 1 rows within BF16_AGREEMENT, on a well-conditioned model only (none otherwise)."""
    measured = [r for r in rows if "control" not in r]
    if ctx.device == "cpu":
        worst = max(r["over_outlier"] for r in measured)
        return [goal(f"share of tokens with |Δ logprob| > {OUTLIER} (engine vs trainer)", worst, 0.001)]
    if init is None or init > WELL_CONDITIONED:
        return []
    held = [r for r in measured if r["temperature"] >= 0.7 and r["top_p"] == 1.0]
    names = {"mean_abs": "mean |Δ logprob| per token", "max_abs": "max |Δ logprob|",
             "over_outlier": f"share of tokens with |Δ logprob| > {OUTLIER}"}
    return [goal(f"{names[key]} at T >= 0.7, top_p 1 (engine vs trainer, bfloat16)",
                 max(r[key] for r in held), bound) for key, bound in BF16_AGREEMENT.items()]
