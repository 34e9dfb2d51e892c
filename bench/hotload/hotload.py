"""Scenario 2: hot-load against the alternatives, same model, same run, one engine.

How long until a new policy answers, three ways, against an engine this scenario starts
itself (the transformers engine, or SGLang the way tandem's launcher starts it):

    (a) hot-load        POST /load_lora_adapter, then the first /generate on that adapter
    (b) restart         stop the engine, start it, wait for /health, load the adapter, first
                        /generate: what a deployment without hot-loading does for each version
    (c) merge + reload  merge the adapter into the base weights (peft merge_and_unload) and save
                        the full model, POST /update_weights_from_disk, first /generate on the
                        base model

Every first /generate is the same request: a fixed 16-token prompt, 4 greedy tokens with
logprobs. The report gives p50 totals and parts, the ratios (b)/(a) and (c)/(a), and checks
the goal "hot-load at least 100x faster than an engine restart" (stated for the GPU). It also
checks that (c) really changed the served weights: the merged base answers with the adapter's
tokens, and its logprobs differ from the base model's.

Order: one warm-up hot-load (the transformers engine wraps the model in PEFT on the first
adapter; reported, not in the p50), K hot-loads, the merges, then the restarts (a restart
brings the original base weights back). Hot-loaded adapters are unloaded once two newer ones
are loaded, as the controller does.

The scenario's parts: hotload_engine.py (the engine process and its client),
hotload_measurements.py (the three approaches, timed), hotload_adapters.py (the adapters and
the merge, in an interpreter with torch), hotload_report.py (p50s, ratios, goal, table, plot).

The merge runs in a subprocess of the first interpreter that imports torch, transformers and
peft (`ctx.trainer_python` when the context has one, then `ctx.tandem_python`, this one,
`ctx.sglang_python`); its time is what loading the base, merging and saving take in that process
(interpreter start and imports are reported apart). Without such an interpreter (c) is reported
as not measured. A step that fails is a row with its error, and the report names it; the other
steps go on. With no published versions in the store, random LoRA adapters (r=16 on the seven
projections) are made first.

    python bench/hotload/hotload.py run --quick --out /tmp/hotload        # tiny model, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench` when run as a script

from bench.hotload.hotload_adapters import adapters, interpreter, make_adapters, merge
from bench.hotload.hotload_measurements import measure
from bench.hotload.hotload_report import report

__all__ = ["counts", "main", "report", "run"]


def counts(quick: bool) -> tuple[int, int, int]:
    """(hot-loads, restarts, merges)."""
    return (2, 1, 1) if quick else (5, 2, 2)


def run(ctx: Any) -> dict[str, Any]:
    k, restarts, merges = counts(ctx.quick)
    out = Path(ctx.out)
    out.mkdir(parents=True, exist_ok=True)
    merge_python, why = interpreter(ctx, "the merge")
    if merge_python is None:
        ctx.progress(f"hotload: (c) cannot be measured: {why}")
        merges = 0
    chosen = adapters(ctx, max(k, merges))
    ctx.progress(f"hotload: {ctx.engine} engine, model {ctx.model}; {k} hot-loads, {merges} merges, "
                 f"{restarts} restarts over {len(chosen)} adapter(s)")
    rows = asyncio.run(measure(ctx, chosen, k, restarts, merges, merge_python or ""))
    if merge_python is None:
        rows.append({"approach": "merge-reload", "i": 0, "error": why})
    result = report(ctx, rows, out)
    result["summary"]["merge_python"] = merge_python
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="the scenario on its own")
    p_run.add_argument("--quick", action="store_true")
    p_run.add_argument("--out", default=None, help="default: bench/results/hotload-<timestamp>")
    p_run.add_argument("--model", default=None, help="default: the tiny model (built if needed)")
    p_run.add_argument("--engine", choices=["transformers", "sglang", "vllm"], default="transformers")
    p_run.add_argument("--store", default=None, help="adapter store root (default: random adapters)")
    p_run.add_argument("--run-name", default="bench")
    p_run.add_argument("--tandem-python", default=sys.executable)
    p_run.add_argument("--sglang-python", default="python3")
    p_run.add_argument("--vllm-python", default="python3")
    p_run.add_argument("--trainer-python", default=None, help="interpreter with torch + peft for the merge")
    p_run.add_argument("--engine-env", default="{}", help="JSON object of extra engine environment variables")
    p_merge = sub.add_parser("merge", help="(internal) merge an adapter into a base model and save it")
    p_adapters = sub.add_parser("adapters", help="(internal) make random LoRA adapters")
    for p in (p_merge, p_adapters):
        p.add_argument("--base", required=True)
        p.add_argument("--out", required=True)
    p_merge.add_argument("--adapter", required=True)
    p_adapters.add_argument("--count", type=int, default=2)
    args = parser.parse_args()
    if args.command == "merge":
        print(json.dumps(merge(args.base, args.adapter, args.out)))
        return 0
    if args.command == "adapters":
        make_adapters(args.base, args.out, args.count)
        return 0

    from types import SimpleNamespace

    out = Path(args.out or f"bench/results/hotload-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}").resolve()
    model = args.model
    if model is None:
        from tandem_trainer.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(".tandem/models/tiny")).resolve())
    ctx = SimpleNamespace(
        out=out, quick=args.quick, model=model, engine=args.engine, tandem_python=args.tandem_python,
        sglang_python=args.sglang_python, vllm_python=args.vllm_python, trainer_python=args.trainer_python,
        engine_env=json.loads(args.engine_env),
        store_root=Path(args.store or out / "no-store"), run_name=args.run_name,
        progress=lambda msg: print(f"  {msg}", flush=True),
    )
    t0 = time.monotonic()
    result = run(ctx)
    (out / "hotload.json").write_text(json.dumps(result, indent=1))
    print(result["table"])
    for g in result["goals"]:
        print(f"goal {'met' if g['met'] else 'MISSED'}: {g['name']}: {g['value']} (target >= {g['target']}) {g['note']}")
    print(f"{time.monotonic() - t0:.1f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
