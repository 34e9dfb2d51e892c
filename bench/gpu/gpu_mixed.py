"""On a GPU: SGLang or vLLM as tandem launches it, checked against references instead of timed.

1. Batch invariance across adapters: a random model of a real shape, four random rank-16
   adapters A-D with distinct weights, greedy decoding. Each (prompt, adapter) alone is the
   reference; then batches fired at once (every prompt with base and A-D; 32 x A; 16 x A +
   16 x B; A, B, C, D one each; one prompt with A and with B, the shape of a version swap),
   each twice. A request is right when its tokens equal its solo tokens, all of them.
2. Rollout/trainer agreement: samples of adapter A at temperatures 0.3, 0.7 and 1.0, with and
   without top_p 0.9, their logprobs as the engine returns them, recomputed by the trainer's peft
   backend (bfloat16 on the GPU) on the same adapter, in tandem's convention (each sample's
   temperature) and in the unscaled one tandem's trainer used before.

One SGLang server per `--lora-backends` entry (tandem's own flags from `sglang_argv`, CUDA
graphs on, as shipped), one after the other on GPU 0; with `--engine vllm` one vLLM server
(tandem's flags from `vllm_argv`). Every call goes through the engine's `Engine` client, as the
gateway's do. Results: OUT/results.json, OUT/report.md.

    python bench/gpu/gpu_mixed.py --out /tmp/mixed --sglang-python /tmp/sgpython --lora-backends csgmv,triton
    python bench/gpu/gpu_mixed.py --out /tmp/mixed-vllm --engine vllm --vllm-python /opt/vllm/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tandem.logprobs import Mismatch
from tandem.runs import LoraConfig, RunSpec
from tandem.settings import EngineSettings, InferenceSettings
from tandem.trajectories import Sample
from tandem_inference.engines import connect, own_engine
from tandem_inference.engines.base import Generated, Sampling

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench` when run as a script

from bench.benchlib import SGLANG_FLAGS, SHAPES

ADAPTERS = ["A", "B", "C", "D"]
NEW_TOKENS = 48


async def _complete(engine: EngineSettings, ids: list[int], adapter: str | None, sampling: Sampling) -> Generated:
    async with httpx.AsyncClient() as http:
        (out,) = await connect(engine, http).complete(ids, sampling, adapter=adapter)
    return out


def generate(engine: EngineSettings, ids: list[int], adapter: str | None, sampling: Sampling) -> Generated:
    """One sample through the engine's `Engine` client (one event loop per calling thread)."""
    return asyncio.run(_complete(engine, ids, adapter, sampling))


def greedy(engine: EngineSettings, ids: list[int], adapter: str | None) -> list[int]:
    return generate(engine, ids, adapter, Sampling(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)).token_ids


TIE_NATS = 0.1
"""Where a solo output's best two tokens lie closer than this, the step is a tie: bfloat16 batching
may pick either (the engine's logprobs themselves differ from the trainer's by 0.01-0.08 nats)."""


def solo(engine: EngineSettings, ids: list[int], adapter: str | None) -> tuple[list[int], list[float | None]]:
    """The greedy reference alone, with its margin at each step: best logprob minus the runner-up's."""
    out = generate(engine, ids, adapter,
                   Sampling(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, top_logprobs=2))
    margins = [top[0][0] - top[1][0] if top and len(top) > 1 else None for top in out.top_logprobs]
    return out.token_ids, margins


def at_once(engine: EngineSettings, batch: list[tuple[int, str | None]], prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda r: greedy(engine, prompts[r[0]], r[1]), batch))


def start(settings: InferenceSettings, log: Path) -> subprocess.Popen[bytes]:
    own = own_engine(settings)
    assert own is not None, settings.engine.kind
    print(f"{settings.engine.kind}:", " ".join(own.argv), flush=True)
    with log.open("wb") as sink:  # the engine writes through its own copy of the descriptor
        proc = subprocess.Popen(own.argv, env=own.env, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{settings.engine.kind} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{settings.engine.url}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.kill()
    raise SystemExit(f"{settings.engine.kind} did not answer /health in 900 s")


def mixed_batches(engine: EngineSettings, prompts: list[list[int]]) -> dict[str, Any]:
    everyone: list[str | None] = [None, *ADAPTERS]
    references = {(p, a): solo(engine, prompts[p], a) for p in range(len(prompts)) for a in everyone}
    alone = {r: ids for r, (ids, _) in references.items()}
    distinct = len({tuple(tuple(alone[p, a]) for p in range(len(prompts))) for a in everyone})
    batches: dict[str, list[tuple[int, str | None]]] = {
        "prompts x {base, A, B, C, D}, 32 requests": [(i % len(prompts), everyone[i % 5]) for i in range(32)],
        "32 x A (batching-noise control)": [(i % len(prompts), "A") for i in range(32)],
        "16 x A + 16 x B": [(i % len(prompts), "A" if i < 16 else "B") for i in range(32)],
        "A, B, C, D one each": [(0, a) for a in ADAPTERS],
        "one prompt with A and with B (a version swap)": [(1, "A"), (1, "B")],
    }
    rows = []
    for name, batch in batches.items():
        for attempt in (1, 2):
            got = at_once(engine, batch, prompts)
            right = [ids == alone[r] for r, ids in zip(batch, got, strict=True)]
            wrong_by = sorted({str(r[1] or "base") for r, ok in zip(batch, right, strict=True) if not ok})
            first_bad: list[int | None] = [next((k for k, (x, y) in enumerate(zip(ids, alone[r], strict=False)) if x != y), None)
                         for r, ids, ok in zip(batch, got, right, strict=True) if not ok]
            wrong = [r for r, ok in zip(batch, right, strict=True) if not ok]
            # [prompt, adapter, first step apart, the solo output's margin there] of each wrong request
            departed = [[p, a or "base", k, margin_at(references[p, a][1], k)]
                        for (p, a), k in zip(wrong, first_bad, strict=True)]
            rows.append({"batch": name, "attempt": attempt, "exact": sum(right), "requests": len(batch),
                         "wrong_from_first_decode_step": sum(1 for k in first_bad if k is not None and k <= 1),
                         "departed_beyond_ties": sum(1 for d in departed if d[3] is None or d[3] > TIE_NATS),
                         "wrong_adapters": wrong_by, "first_wrong_step": first_bad[:8], "departed": departed})
            print(f"  {name} #{attempt}: {sum(right)}/{len(batch)} exact; wrong: {wrong_by}", flush=True)
    return {"distinct_solo_outputs": distinct, "rows": rows}


def margin_at(margins: list[float | None], step: int | None) -> float | None:
    """The solo output's margin at `step` (None: a length mismatch, or no alternatives listed)."""
    return margins[step] if step is not None and step < len(margins) else None


SETTINGS = [(None, 1.0, 1.0)] + [("A", t, p) for t in (0.3, 0.7, 1.0) for p in (1.0, 0.9)]
"""(adapter, temperature, top_p): the base model at T = 1 calibrates the numerical noise."""


def sample_logprobs(engine: EngineSettings, prompts: list[list[int]]) -> list[dict[str, Any]]:
    out = []
    for adapter, temperature, top_p in SETTINGS:
        for ids in prompts:
            got = generate(engine, ids, adapter, Sampling(max_tokens=NEW_TOKENS, temperature=temperature, top_p=top_p,
                                                          ignore_eos=True))
            out.append({"adapter": adapter, "temperature": temperature, "top_p": top_p, "prompt_ids": ids,
                        "completion_ids": got.token_ids, "rollout_logprobs": got.logprobs})
    return out


def agreement(model: Path, adapter_dir: Path, samples: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    from tandem_trainer.backends.peft import PeftBackend
    from tandem_trainer.logprob_check import recompute

    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    spec = RunSpec(name="mixed", base_model=str(model),
                   lora=LoraConfig(r=saved["r"], alpha=float(saved["lora_alpha"]), target_modules=saved["target_modules"]))
    version_dir = work / "v1"
    shutil.copytree(adapter_dir, version_dir / "adapter", dirs_exist_ok=True)
    backend = PeftBackend("cuda")
    rows = []
    for adapter, temperature, top_p in SETTINGS:
        picked = [s for s in samples if (s["adapter"], s["temperature"], s["top_p"]) == (adapter, temperature, top_p)]
        trajs = [Sample(prompt_ids=s["prompt_ids"], completion_ids=s["completion_ids"],
                        rollout_logprobs=s["rollout_logprobs"], temperature=temperature) for s in picked]
        engine = [s["rollout_logprobs"] for s in picked]
        conventions = [("scaled (tandem now)", None)] + ([("unscaled (tandem before)", 1.0)] if temperature != 1.0 else [])
        for convention, t in conventions:
            trainer = recompute(backend, spec, 1 if adapter else 0, version_dir if adapter else None, trajs,
                                temperature=t)
            m = Mismatch.of(engine, trainer)
            rows.append({"adapter": adapter or "base", "temperature": temperature, "top_p": top_p,
                         "trainer_convention": convention, **vars(m)})
            print(f"  {adapter or 'base'} T={temperature} top_p={top_p} {convention}: mean {m.mean_abs:.3e} "
                  f"max {m.max_abs:.3e} >0.1 {m.over_outlier:.4f} ratio {m.ratio_mean:.4f}", flush=True)
    return rows


def serve_and_check(model: Path, adapters: dict[str, Path], prompts: list[list[int]], *, backend: str | None,
                    sglang_python: str = "python3", port: int, out: Path, engine_kind: str = "sglang",
                    vllm_python: str = "python3", engine_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine server as tandem launches it (SGLang: `backend` None is the shipped `engine.lora_backend`):
    the mixed batches against solo outputs, and samples of adapter A for the agreement check.
    `engine_fields`: more EngineSettings fields (a lever to check, e.g. prefill_graphs_from_one_token)."""
    engine = EngineSettings(kind=engine_kind, model=str(model), url=f"http://127.0.0.1:{port}",  # type: ignore[arg-type]
                            sglang_python=sglang_python, vllm_python=vllm_python, max_lora_rank=16,
                            extra_args=SGLANG_FLAGS if engine_kind == "sglang" else [], mem_fraction_static=0.5,
                            **(engine_fields or {}))
    if backend is not None:
        engine = engine.model_copy(update={"lora_backend": backend})
    settings = InferenceSettings(engine=engine, gpus={"mode": "split", "inference": [0], "trainer": [1]})
    name = engine.lora_backend if engine_kind == "sglang" else engine_kind
    proc = start(settings, out / f"{engine_kind}-{name}.log")
    try:
        async def load() -> None:
            async with httpx.AsyncClient() as http:
                client = connect(engine, http)
                for adapter, path in adapters.items():
                    await client.load_adapter(adapter, str(path))

        asyncio.run(load())
        print(f"== {name}: mixed batches", flush=True)
        own = own_engine(settings)
        res: dict[str, Any] = {"argv": own.argv if own else [], "mixed": mixed_batches(engine, prompts)}
        print(f"== {name}: sampling for agreement", flush=True)
        res["samples"] = sample_logprobs(engine, prompts)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return res


def report(results: dict[str, Any]) -> str:
    lines = [f"# {results.get('engine', 'sglang')}: mixed-adapter batches and logprob agreement ({results['shape']}, "
             f"initializer_range {results['initializer_range']}, adapter B std {results['adapter_scale']})", ""]
    for backend, res in results["backends"].items():
        title = f"--lora-backend {backend}" if results.get("engine", "sglang") == "sglang" else backend
        lines += [f"## {title}", "", f"distinct solo outputs over base and A-D (all prompts): "
                  f"{res['mixed']['distinct_solo_outputs']} of 5", "",
                  "| batch | run | exact / requests | wrong from the first decode step | departed beyond a tie | "
                  "wrong adapters | first wrong step |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["mixed"]["rows"]:
            lines.append(f"| {r['batch']} | {r['attempt']} | {r['exact']} / {r['requests']} | "
                         f"{r['wrong_from_first_decode_step']} | {r.get('departed_beyond_ties', '–')} | "
                         f"{', '.join(r['wrong_adapters']) or '–'} | "
                         f"{r['first_wrong_step'] or '–'} |")
        lines += ["", "| adapter | T | top_p | trainer convention | tokens | mean abs | max abs | share > 0.1 | ratio mean |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in res.get("agreement", []):
            lines.append(f"| {r['adapter']} | {r['temperature']} | {r['top_p']} | {r['trainer_convention']} | {r['tokens']} | "
                         f"{r['mean_abs']:.2e} | {r['max_abs']:.2e} | {r['over_outlier']:.4f} | {r['ratio_mean']:.4f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/gpu-mixed", help="model and adapters (large)")
    p.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    p.add_argument("--sglang-python", default="python3")
    p.add_argument("--vllm-python", default="python3")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--lora-backends", default="csgmv,triton", help="SGLang's LoRA backends, one server each")
    p.add_argument("--port", type=int, default=30123)
    p.add_argument("--initializer-range", type=float, default=0.02,
                   help="the random model's weight scale (a real model's is about 0.02; larger ones make bf16 chaotic)")
    p.add_argument("--adapter-scale", type=float, default=None,
                   help="std of the adapters' B matrices (default: the initializer range, a delta of a real adapter's size)")
    args = p.parse_args()
    from tandem_trainer.tiny_model import build_random_adapter, build_tiny_model

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    shape = {**SHAPES[args.shape], "initializer_range": args.initializer_range}
    model_dir = work / f"model-{args.shape}-{args.initializer_range}"
    model = model_dir if model_dir.exists() else build_tiny_model(model_dir, **shape)
    scale = args.adapter_scale if args.adapter_scale is not None else args.initializer_range
    adapters = {name: build_random_adapter(model, work / f"{model_dir.name}-{scale}-{name}", rank=16, seed=i + 1,
                                           scale=scale) for i, name in enumerate(ADAPTERS)}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 24))] for _ in range(4)]
    results: dict[str, Any] = {"shape": args.shape, "initializer_range": args.initializer_range,
                               "adapter_scale": scale, "engine": args.engine, "backends": {}}
    backends: list[str | None] = list(args.lora_backends.split(",")) if args.engine == "sglang" else [None]
    for backend in backends:
        results["backends"][backend or args.engine] = serve_and_check(
            model, adapters, prompts, backend=backend, sglang_python=args.sglang_python, port=args.port, out=out,
            engine_kind=args.engine, vllm_python=args.vllm_python)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    for backend, res in results["backends"].items():
        print(f"== {backend}: trainer recompute", flush=True)
        res["agreement"] = agreement(model, adapters["A"], res.pop("samples"), work / f"trainer-{backend}")
        (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
