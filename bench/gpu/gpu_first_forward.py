"""On a GPU: where the first response after an adapter load spends its time.

The suite's sync scenario finds the first one-token request served by a freshly loaded version
slower than the engine's load itself (0.5B split, SGLang 0.5.23: load 53 ms, first response
68 ms p50, against a few ms for the same request once the adapter has served). This separates
the candidates, on one engine started the way tandem starts it (`engines.own_engine`, shipped
flags plus each variant's), for `--rounds` fresh adapter names per variant:

- load: the engine's load call, as the controller times it (no request in flight);
- first / second: the same one-token request (the sync probe's) right after the load, then again;
- warmed: with a one-token request on another prompt first (a pre-warmed slot), then the probe;
- again: the probe once more on that adapter, its prompt now in the adapter's prefix cache;
- base: the probe without an adapter (its prompt cached too, from the rounds before);
- with `--profile` (SGLang): the engine's own torch profile (`/start_profile`, CPU and GPU
  activities, Python stacks) of one load and of the first request after it, its busiest
  kernels, operations and Python functions summed (a function's time includes its callees').

Variants: `plain` (tandem's settings as shipped), `overlap` (`--enable-lora-overlap-loading`:
SGLang copies an adapter's weights to the GPU beside compute), `no-small-prefill`
(`engine.prefill_graphs_from_one_token` off: prefill CUDA graphs only of SGLang's own sizes, the
smallest 4 in 0.5.23; SGLang runs a prefill eagerly where the graph would pad it more than twice,
so a prompt whose prefix is cached but for its last token, as `second`, `again` and `base` are,
then runs all layers eagerly), `lazy` (`engine.eager_adapter_slot` off: the adapter goes into its
GPU slot in its first batch, not at its load, as SGLang does without tandem's patch). The report
says which patches the engine had. SGLang's kernels are those it picks itself unless `--kernels
bench`. The adapter is saved in bfloat16, as the trainer publishes it for a bfloat16 model.
Results: OUT/results.json and OUT/report.md.

    python bench/gpu/gpu_first_forward.py --out OUT --sglang-python /tmp/sgpython --shape 0.5b --profile
    python bench/gpu/gpu_first_forward.py --out /tmp/ff --engine transformers --shape tiny --rounds 3   # CPU dry run
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from tandem_inference.engines.base import Engine, Sampling

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench` when run as a script

from bench.benchlib import KERNELS, SHAPES, engine_patches
from bench.gpu import one_engine

#: What each variant changes of tandem's engine settings (`extra_args`: flags after tandem's own)
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "overlap": {"extra_args": ("--enable-lora-overlap-loading",)},
    "no-small-prefill": {"prefill_graphs_from_one_token": False},
    "lazy": {"eager_adapter_slot": False},
}
ONE = Sampling(max_tokens=1)
PROBE = [3, 17, 9]  # the sync probe's size: a prompt of a few tokens, one new token
WARM = [5, 11]


async def timed(engine: Engine, prompt: list[int], adapter: str | None) -> float:
    t0 = time.perf_counter()
    await engine.complete(prompt, ONE, adapter=adapter)
    return (time.perf_counter() - t0) * 1000


async def rounds(engine: Engine, adapter_path: Path, n: int, tag: str) -> list[dict[str, float]]:
    rows = []
    for i in range(n):
        cold, warm = f"{tag}-cold-{i}", f"{tag}-warm-{i}"
        load_ms = await engine.load_adapter(cold, str(adapter_path))
        first = await timed(engine, PROBE, cold)
        second = await timed(engine, PROBE, cold)
        await engine.load_adapter(warm, str(adapter_path))
        warm_up = await timed(engine, WARM, warm)
        warmed = await timed(engine, PROBE, warm)
        again = await timed(engine, PROBE, warm)
        base = await timed(engine, PROBE, None)
        rows.append({"load_ms": load_ms, "first_ms": first, "second_ms": second, "warm_up_ms": warm_up,
                     "warmed_first_ms": warmed, "again_ms": again, "base_ms": base})
        for name in (cold, warm):
            await engine.unload_adapter(name)
    return rows


async def profiled(http: httpx.AsyncClient, url: str, trace_dir: Path, what: Callable[[], Awaitable[float]]
                   ) -> dict[str, Any]:
    """SGLang's own profile of `what` (which returns its ms): its busiest names, summed."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    before = set(trace_dir.rglob("*.json*"))
    await http.post(f"{url}/start_profile", json={"output_dir": str(trace_dir), "activities": ["CPU", "GPU"],
                                                  "with_stack": True}, timeout=60)
    ms = await what()
    await http.post(f"{url}/stop_profile", timeout=300)
    traces = sorted(set(trace_dir.rglob("*.json*")) - before)
    return {"ms": ms, "traces": [p.name for p in traces], **summarize(traces)}


async def profile_load_and_first(http: httpx.AsyncClient, url: str, engine: Engine, adapter_path: Path,
                                 trace_dir: Path) -> dict[str, Any]:
    """The engine's profiles of one load and of the first request after it, each on its own."""
    load = await profiled(http, url, trace_dir / "load",
                          lambda: engine.load_adapter("profiled", str(adapter_path)))
    first = await profiled(http, url, trace_dir / "first", lambda: timed(engine, PROBE, "profiled"))
    return {"load": load, "first": first}


def summarize(traces: list[Path], top: int = 15) -> dict[str, Any]:
    """Microseconds by event name, for GPU kernels and copies, CPU operations and Python functions
    (each with its callees), over `traces`."""
    gpu: defaultdict[str, float] = defaultdict(float)
    cpu: defaultdict[str, float] = defaultdict(float)
    python: defaultdict[str, float] = defaultdict(float)
    for path in traces:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for ev in events:
            if ev.get("ph") != "X" or "dur" not in ev:
                continue
            cat = str(ev.get("cat", ""))
            buckets = {"kernel": gpu, "gpu_memcpy": gpu, "gpu_memset": gpu, "cpu_op": cpu, "python_function": python}
            bucket = buckets.get(cat)
            if bucket is not None:
                bucket[str(ev.get("name", ""))[:120]] += float(ev["dur"])
    def busiest(us: dict[str, float], n: int) -> list[tuple[str, float]]:
        return sorted(us.items(), key=lambda kv: -kv[1])[:n]

    return {"gpu_us": busiest(gpu, top), "cpu_op_us": busiest(cpu, top), "python_us": busiest(python, 2 * top),
            "gpu_total_us": sum(gpu.values()), "cpu_op_total_us": sum(cpu.values())}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem_trainer.tiny_model import build_random_adapter, build_tiny_model

    work = args.out / "work"
    model = build_tiny_model(work / "model", **{**SHAPES[args.shape], "initializer_range": 0.02})
    adapter = build_random_adapter(model, work / "adapter", rank=16, seed=1, scale=0.02, dtype="bfloat16")
    out: dict[str, Any] = {"shape": args.shape, "engine": args.engine, "variants": {}}
    variants = args.variants.split(",") if args.engine == "sglang" else ["plain"]
    if args.engine == "sglang":
        out["patches"] = engine_patches(args.sglang_python, "sglang")
    for variant in variants:
        inference = one_engine.settings(args.engine, model, work, port=args.port, sglang_python=args.sglang_python,
                                        kernels=args.kernels, **VARIANTS[variant])
        log = args.out / f"{args.engine}-{variant}.log"
        async with httpx.AsyncClient() as http, one_engine.serving(inference, http, log) as (engine, boot_s, argv):
            await rounds(engine, adapter, 1, f"{variant}-settle")  # the base model's one-off LoRA wrap
            rows = await rounds(engine, adapter, args.rounds, variant)
            res: dict[str, Any] = {"boot_s": boot_s, "argv": argv, "rows": rows,
                                   "eager_adapter_slot": inference.engine.eager_adapter_slot,
                                   "p50": {k: statistics.median(r[k] for r in rows) for k in rows[0]}}
            if args.profile and args.engine == "sglang":
                res["profile"] = await profile_load_and_first(http, inference.engine.url, engine, adapter,
                                                              work / f"trace-{variant}")
        out["variants"][variant] = res
        print(f"{variant}: " + ", ".join(f"{k} {v:.1f}" for k, v in res["p50"].items()), flush=True)
    return out


def report(res: dict[str, Any]) -> str:
    keys = ["load_ms", "first_ms", "second_ms", "warm_up_ms", "warmed_first_ms", "again_ms", "base_ms"]
    lines = [f"# First response after a load ({res['engine']}, {res['shape']}), p50 ms", ""]
    if res.get("patches"):
        lines += [f"tandem's SGLang patches: {res['patches']}", ""]
    lines += ["| variant | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, v in res["variants"].items():
        lines.append(f"| {name} | " + " | ".join(f"{v['p50'][k]:.1f}" for k in keys) + " |")
    for name, v in res["variants"].items():
        for what, p in (v.get("profile") or {}).items():
            lines += ["", f"## {name}: the engine's profile of one {'load' if what == 'load' else 'first request'} "
                          f"({p['ms']:.1f} ms)", "",
                      f"GPU {p['gpu_total_us'] / 1000:.1f} ms, CPU operations {p['cpu_op_total_us'] / 1000:.1f} ms", "",
                      "| GPU kernel or copy | µs |", "|---|---|"]
            lines += [f"| `{n}` | {us:.0f} |" for n, us in p["gpu_us"]]
            lines += ["", "| CPU operation | µs |", "|---|---|"] + [f"| `{n}` | {us:.0f} |" for n, us in p["cpu_op_us"]]
            lines += ["", "| Python function (with its callees) | µs |", "|---|---|"]
            lines += [f"| `{n}` | {us:.0f} |" for n, us in p.get("python_us", [])]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    one_engine.add_arguments(p, port=30191)
    p.add_argument("--kernels", choices=KERNELS, default="shipped",
                   help="SGLang's kernels: those it picks with tandem's command line (shipped), or the pinned ones "
                        "of the first GPU runs (bench)")
    p.add_argument("--variants", default="plain,lazy,no-small-prefill", help=f"comma-separated, of {sorted(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="SGLang's torch profile of one first request")
    args = p.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: {sorted(unknown)} unknown; choose from {sorted(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    res = asyncio.run(run(args))
    (args.out / "results.json").write_text(json.dumps(res, indent=1))
    (args.out / "report.md").write_text(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
