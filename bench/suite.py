"""`make bench`: what tandem exists for, measured side by side with the alternatives in one run.

Starts the stack (CPU profile by default: tiny model, transformers engine, peft trainer; or
SGLang or vLLM + Unsloth on GPUs with --engine sglang or --engine vllm), runs the scenarios in order, and writes
bench/results/<timestamp>/ with results.json, report.md and the PNG plots:

    1 sync          policy-sync latency per stage, against the floor (write + read + copy)
   14 versions      many adapter versions through few engine slots: every answer checked against the
                    reference of the version asked for (references from the same engine, each version alone)
    3 swaps         serving during swaps: concurrent clients while versions are published
    4 gateway       gateway overhead: the same load through the gateway and straight to the engine
    6 prefix_cache  prefix-cache share of a shared system prompt after each swap
    5 pipeline      sync vs async RL on the toy task (max_staleness 0, 1, 2)
    7 load          the gateway saturated: a small request's and /ready's latency, the share refused (429)
    9 agreement     rollout vs trainer logprobs of the same tokens at T 0.3/0.7/1.0, top_p 1/0.9
   10 throughput    rollout throughput at 1/8/64 clients x 1/4/16 resident adapters
   11 memory        the engine's memory (GPU, RSS) across 100 published versions: flat or leaking
   12 density       1, 8 and 32 runs on one base, each rolling out and training at once: aggregate
                    tokens/s, per-run steps/min, step -> served, fairness, against one run
   13 tinker        the tinker SDK: save_weights_and_get_sampling_client -> the first token sampled by
                    the new weights, p50/p95, beside Miles' 5.19 s and the GPU goal (<= 200 ms p50)
    2 hotload       hot-load vs engine restart vs merged-weights reload (after the stack stops)
    8 replicas      one inference replica against two behind the router: throughput, latency,
                    publish -> served on every replica (stacks of its own, CPU only)

    python bench/suite.py                      # the whole suite, about 11 min on 2 CPU cores
    python bench/suite.py --quick              # every scenario, small (CI), about 3 min
    python bench/suite.py --only sync,hotload
    python bench/suite.py --engine sglang --shape 0.5b --sglang-python /opt/sglang/bin/python \\
        --trainer-python /opt/trainer/bin/python          # GPUs, split mode (GPU 0 and 1)
    python bench/suite.py --engine vllm --shape 0.5b --vllm-python /opt/vllm/bin/python \
        --trainer-python /opt/trainer/bin/python          # the same loop with vLLM (make bench ENGINE=vllm)

Every goal of the suite is checked and the report says which were met and which were missed;
the exit status is non-zero only when a scenario failed to run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from tandem import Client
from tandem.dev.composition import StackConfig
from tandem.errors import StackError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `bench` when run as a script

from bench.benchlib import (
    KERNELS,
    SHAPES,
    BenchStack,
    Ctx,
    bench_run,
    engine_patches,
    machine,
    md_table,
    package_versions,
    python_versions,
    sglang_flags,
)
from bench.report import engine_log

ON_STACK = ["sync", "versions", "swaps", "gateway_overhead", "prefix_cache", "pipeline", "load", "agreement", "throughput",
            "memory", "density", "tinker"]
AFTER_STACK = ["hotload", "replicas"]
#: Adapters the engine holds: bench's and the pipeline runs' two versions each (8), the throughput
#: scenario's 16 runs one each, and the density scenario's 32 runs of its largest count (it deletes
#: each count's runs after it) up to three each: a pipelined run's requests still hold its previous
#: version while the next loads (at 64 the engine refused versions of 32 runs on 2 CPU cores).
MAX_LOADED_ADAPTERS = 128
ALIASES = {"gateway": "gateway_overhead", "prefix": "prefix_cache", "async": "pipeline"}
#: gateway.queue_timeout_s of the suite's stack (30 s by default): short enough that the head of the
#: load scenario's queue, which waits about max_queued_requests / served per s (10 s on 2 CPU
#: cores), turns overdue (half of it) within the scenario. No other scenario fills the budget.
QUEUE_TIMEOUT_S = 8


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replot", metavar="DIR", help="only redraw the plots of an earlier run from DIR/results.json")
    p.add_argument("--quick", action="store_true", help="every scenario, small: keeps the suite working in CI")
    p.add_argument("--only", default="", help=f"comma-separated scenarios of {ON_STACK + AFTER_STACK}")
    p.add_argument("--out", default=None, help="default: bench/results/<timestamp>")
    p.add_argument("--state", default=None, help="the stack's state: adapters, Redis, logs (default: OUT/stack)")
    p.add_argument("--model", default=None, help="a local model dir (default: build the tiny model / --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--engine", choices=["transformers", "sglang", "vllm"], default="transformers")
    p.add_argument("--mode", choices=["split", "shared"], default="split", help="GPU mode with a GPU engine")
    p.add_argument("--sglang-python", default="python3")
    p.add_argument("--vllm-python", default="python3")
    p.add_argument("--trainer-python", default=sys.executable)
    p.add_argument("--tandem-python", default=sys.executable)
    p.add_argument("--inference-gpus", default="[0]")
    p.add_argument("--trainer-gpus", default="[1]")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="SGLang's --mem-fraction-static (vLLM's --gpu-memory-utilization); default 0.7 split, 0.6 shared")
    p.add_argument("--engine-args", default="[]",
                   help="more engine flags as a JSON list, after the suite's own (a lever to measure, e.g. "
                        "'[\"--enable-lora-overlap-loading\"]')")
    p.add_argument("--release-tags", default=None,
                   help="shared mode: gpus.release_tags as JSON (default the settings' [\"kv_cache\"]; [] frees nothing)")
    p.add_argument("--serve-while-training", action="store_true",
                   help="shared mode with --release-tags '[]': gpus.serve_while_training, the engine serves while "
                        "the trainer steps (no hand-over)")
    p.add_argument("--density-runs", type=run_counts, default=(),
                   help="run counts of the density scenario, comma-separated (default 1,8,32; --quick 1,4)")
    p.add_argument("--kernels", choices=KERNELS, default="shipped",
                   help="SGLang's kernels: those tandem's command line gets (shipped: fa3 attention, flashinfer "
                        "sampling on H100/H200), or the pinned triton attention and PyTorch sampling of the first "
                        "GPU runs (bench), a lever to measure beside them")
    p.add_argument("--eager-adapter-slot", choices=["on", "off"], default="on",
                   help="SGLang: engine.eager_adapter_slot (default on, as shipped), each adapter copied into a free "
                        "GPU slot when it loads (tandem's patch, images/patches/; the report's meta says whether the "
                        "engine has it); off: in the first batch that uses it")
    p.add_argument("--prefill-graphs-from-one-token", choices=["on", "off"], default="on",
                   help="SGLang: engine.prefill_graphs_from_one_token (default on, as shipped): prefill CUDA graphs "
                        "of 1-3 tokens beside SGLang's own (tandem's patch, images/patches/)")
    p.add_argument("--gather-adapter-copy", choices=["on", "off"], default="on",
                   help="backend.gather_adapter_copy (default on, as shipped): the trainer copies the adapter to "
                        "host memory in one transfer where it casts, concatenated and cast on the device first")
    p.add_argument("--blank-adapter-file", choices=["on", "off"], default="on",
                   help="backend.blank_adapter_file (default on, as shipped): each version's weights are written over "
                        "a file of zeros the trainer wrote after the last version, off the path; off: into a new file")
    p.add_argument("--check-inline", choices=["auto", "on", "off"], default="auto",
                   help="controller.check_inline (default auto, as shipped: the store's checks on the event loop "
                        "where the store is on a local filesystem); off: in a thread")
    p.add_argument("--engine-slots", type=int, default=MAX_LOADED_ADAPTERS,
                   help=f"engine.max_loaded_adapters of the suite's stack (default {MAX_LOADED_ADAPTERS}; "
                        "8, the shipped default, makes the density scenario's runs share 8 slots)")
    p.add_argument("--loras-per-batch", type=int, default=None,
                   help="engine.max_loras_per_batch of a GPU engine (default the settings' 8): adapters mixed in "
                        "one batch; with more runs rolling out at once than this, the engine batches them in turns")
    p.add_argument("--keep-versions", type=int, default=0,
                   help="retention.keep_versions of the suite's stack (default 0 keeps every version; at the 0.5B "
                        "shape a version takes about 125 MB of store, so the density scenario's 32 runs of 8 steps "
                        "write about 32 GB without it)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=64,
                   help="the largest decode batch the engine captures a CUDA graph for: 64 covers the throughput "
                        "grid's 64 clients (at 8, both engines served 64 clients slower than 8)")
    p.add_argument("--agreement-backends", type=backend_list, default=(),
                   help="comma-separated trainer backends (peft, unsloth) the agreement scenario recomputes the "
                        "sampled tokens' logprobs with, each on the same samples (default: the stack's own)")
    return p.parse_args()


def backend_list(text: str) -> tuple[str, ...]:
    """--agreement-backends: peft and/or unsloth, comma-separated."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in ("peft", "unsloth")]
    if unknown or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: give peft and/or unsloth, each once, comma-separated")
    return kinds


def run_counts(text: str) -> tuple[int, ...]:
    """--density-runs: comma-separated counts of runs, each 1 to 256 (the engine's most adapters)."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated numbers of runs, such as 1,8,32") from exc
    if not counts or not all(1 <= c <= 256 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more counts of runs from 1 to 256, such as 1,8,32")
    return counts


def mem_fraction(args: argparse.Namespace) -> float:
    """The engine's share of its GPU: as asked, else 0.7 alone on a GPU (split) and 0.6 beside the trainer (shared)."""
    if args.mem_fraction is not None:
        return float(args.mem_fraction)
    return 0.7 if args.mode == "split" else 0.6


def selected(only: str) -> list[str]:
    if not only:
        return ON_STACK + AFTER_STACK
    names = [ALIASES.get(n.strip(), n.strip()) for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ON_STACK + AFTER_STACK]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; choose from {ON_STACK + AFTER_STACK}")
    return [n for n in ON_STACK + AFTER_STACK if n in names]


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    if args.engine == "transformers":
        return {"TANDEM_ENGINE__KIND": "transformers", "TANDEM_GPUS__MODE": "cpu", "TANDEM_LOG_LEVEL": "INFO",
                "TANDEM_ENGINE__MAX_LOADED_ADAPTERS": str(args.engine_slots),
                "TANDEM_GATEWAY__QUEUE_TIMEOUT_S": str(QUEUE_TIMEOUT_S)}
    env = {
        "TANDEM_GPUS__MODE": args.mode, "TANDEM_GPUS__INFERENCE": args.inference_gpus,
        "TANDEM_GPUS__TRAINER": args.trainer_gpus if args.mode == "split" else "[7]",
        "TANDEM_ENGINE__KIND": args.engine, "TANDEM_ENGINE__SGLANG_PYTHON": args.sglang_python,
        "TANDEM_ENGINE__VLLM_PYTHON": args.vllm_python,
        "TANDEM_ENGINE__MAX_LORA_RANK": "16", "TANDEM_ENGINE__CUDA_GRAPH_MAX_BS": str(args.cuda_graph_max_bs),
        # SGLang in bfloat16 with the kernels it picks itself (--kernels bench: the first runs' pinned
        # ones); vLLM runs with tandem's flags alone
        "TANDEM_ENGINE__EXTRA_ARGS": json.dumps((sglang_flags(args.kernels) if args.engine == "sglang" else [])
                                                + engine_args(args.engine_args)),
        "TANDEM_ENGINE__MEM_FRACTION_STATIC": str(mem_fraction(args)),
        "TANDEM_BACKEND__KIND": "auto", "TANDEM_LOG_LEVEL": "INFO",
        "TANDEM_ENGINE__MAX_LOADED_ADAPTERS": str(args.engine_slots),
        "TANDEM_GATEWAY__MAX_IN_FLIGHT_TOKENS": "524288",  # as compose.yaml: a GPU takes far more than a CPU
        "TANDEM_GATEWAY__MAX_IN_FLIGHT_SEQUENCES": "4096",
        "TANDEM_GATEWAY__QUEUE_TIMEOUT_S": str(QUEUE_TIMEOUT_S),
    }
    env["TANDEM_BACKEND__GATHER_ADAPTER_COPY"] = "true" if args.gather_adapter_copy == "on" else "false"
    env["TANDEM_BACKEND__BLANK_ADAPTER_FILE"] = "true" if args.blank_adapter_file == "on" else "false"
    if args.check_inline != "auto":
        env["TANDEM_CONTROLLER__CHECK_INLINE"] = "true" if args.check_inline == "on" else "false"
    if args.engine == "sglang":
        env["TANDEM_ENGINE__EAGER_ADAPTER_SLOT"] = "true" if args.eager_adapter_slot == "on" else "false"
        env["TANDEM_ENGINE__PREFILL_GRAPHS_FROM_ONE_TOKEN"] = (
            "true" if args.prefill_graphs_from_one_token == "on" else "false")
    if args.loras_per_batch is not None:
        env["TANDEM_ENGINE__MAX_LORAS_PER_BATCH"] = str(args.loras_per_batch)
    if args.release_tags is not None:  # shared mode: what the engine frees for the trainer
        env["TANDEM_GPUS__RELEASE_TAGS"] = args.release_tags
    if args.serve_while_training:
        if args.mode != "shared" or json.loads(args.release_tags or '["kv_cache"]') != []:
            raise SystemExit("--serve-while-training is for --mode shared with --release-tags '[]' (an engine that "
                             "frees its memory for the trainer cannot serve meanwhile)")
        env["TANDEM_GPUS__SERVE_WHILE_TRAINING"] = "true"
    return env


def engine_args(text: str) -> list[str]:
    """--engine-args: a JSON list of strings, or an exit naming what it got."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"--engine-args {text!r} is not JSON ({exc}); give a list such as '[\"--flag\", \"1\"]'") from exc
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SystemExit(f"--engine-args {text!r} is not a JSON list of strings")
    return value


def scenario_module(name: str) -> ModuleType:
    """A scenario's module: bench/scenarios/<name>.py, or the hot-load study's bench/hotload/hotload.py."""
    return importlib.import_module(f"bench.hotload.{name}" if name == "hotload" else f"bench.scenarios.{name}")


def run_scenario(name: str, ctx: Ctx, results: dict[str, Any]) -> None:
    print(f"\n== {name} ==", flush=True)
    t0 = time.time()
    try:
        module = scenario_module(name)
        res = module.run(ctx)
    except Exception as exc:  # noqa: BLE001 - one broken scenario must not hide the others
        traceback.print_exc()
        res = {"name": name, "title": name, "error": f"{type(exc).__name__}: {exc}", "goals": [], "table": "",
               "plots": []}
    res["elapsed_s"] = round(time.time() - t0, 1)
    results[name] = res
    if res.get("table"):
        print(res["table"])
    for g in res.get("goals", []):
        print(f"  goal {'met   ' if g['met'] else 'MISSED'} {g['name']}: {g['value']} (target "
              f"{'<=' if g['at_most'] else '>='} {g['target']})")
    print(f"  ({res['elapsed_s']} s)", flush=True)


def replot(out: Path) -> int:
    """Redraw the plots a scenario can rebuild from its rows (e.g. when a remote run's came back without them)."""
    data = json.loads((out / "results.json").read_text())
    for name, result in data["scenarios"].items():
        module = scenario_module(name)
        if hasattr(module, "replot") and not result.get("error"):
            module.replot(result, out)
            print(f"{name}: plots redrawn in {out}")
    return 0


def main() -> int:
    args = parse()
    if args.replot:
        return replot(Path(args.replot))
    names = selected(args.only)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out or f"bench/results/{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    if args.model:
        model = str(Path(args.model).resolve())
    else:
        from tandem_trainer.tiny_model import build_tiny_model

        model_dir = Path(".tandem/models") / ("tiny" if args.shape == "tiny" else f"bench-{args.shape}")
        print(f"model: {args.shape} at {model_dir} ...", flush=True)
        model = str(build_tiny_model(model_dir, **SHAPES[args.shape]).resolve())
    env = engine_env(args)
    if args.keep_versions:
        env["TANDEM_RETENTION__KEEP_VERSIONS"] = str(args.keep_versions)
    gpu = args.engine != "transformers"
    device = "cuda" if gpu else "cpu"
    state = Path(args.state).resolve() if args.state else out / "stack"
    config = StackConfig(state_dir=state, model=model, gateway_port=0, extra_env=env,
                         ready_timeout_s=1200 if gpu else 180,
                         cpu_threads=1 if args.engine == "transformers" else None)
    ctx = Ctx(out=out, quick=args.quick, model=model, engine=args.engine, tandem_python=args.tandem_python,
              sglang_python=args.sglang_python, vllm_python=args.vllm_python, trainer_python=args.trainer_python,
              engine_env=env, store_root=state / "adapters",
              run_name="bench", device=device, served_model="base", shape=args.shape,
              lr=5e-3 if args.shape == "tiny" else 2e-3, density_runs=args.density_runs,
              agreement_backends=args.agreement_backends)
    meta = {
        "timestamp": stamp, "quick": args.quick, "engine": args.engine, "shape": args.shape, "model": model,
        "mode": args.mode if gpu else "cpu", "machine": machine(), "packages": package_versions(),
        "settings": env,
    }
    if args.engine == "sglang":
        meta["sglang_env"] = python_versions(args.sglang_python, ["sglang", "torch", "transformers"])
        meta["sglang_patches"] = engine_patches(args.sglang_python, "sglang")
    if args.engine == "vllm":
        meta["vllm_env"] = python_versions(args.vllm_python, ["vllm", "torch", "transformers"])
    if gpu:
        meta["trainer_env"] = python_versions(args.trainer_python, ["unsloth", "torch", "transformers", "peft"])
    results: dict[str, Any] = {}

    def write() -> None:  # after every scenario, so a run cut short still leaves its report
        meta["elapsed_s"] = round(time.time() - t_start, 1)
        done = {k: v for k, v in results.items() if not v.get("skipped")}
        (out / "results.json").write_text(json.dumps({"meta": meta, "scenarios": done}, indent=1,
                                                     default=_jsonable))
        (out / "report.md").write_text(report(meta, done))

    on_stack = [n for n in names if n in ON_STACK]
    if on_stack:
        print(f"starting the stack ({args.engine}; logs in {state}/logs) ...", flush=True)
        stack = BenchStack(config, engine=args.engine, tandem_python=args.tandem_python,
                           trainer_python=args.trainer_python, tinker="tinker" in on_stack)
        try:
            stack.start()  # stops what it started when a service fails to
        except StackError as exc:  # an engine that cannot start: say why, with its log's last lines
            results["stack"] = {"title": "The stack", "error": str(exc)}
            write()
            print(f"\nthe stack did not start: {exc}\n{last_lines(stack.logs, args.engine)}", file=sys.stderr)
            return 2
        except BaseException:  # a port in use (ConfigError), Ctrl-C during a long boot: nothing left running
            stack.stop()
            raise
        try:
            print(f"stack ready in {time.time() - t_start:.0f} s", flush=True)
            ctx.stack = stack
            ctx.client = Client(stack.gateway_url, stack.redis_url)
            for name in on_stack:
                if name != "sync" and "sync" not in results and name != "pipeline":
                    # later scenarios publish on the run `sync` creates: create it if sync is
                    # skipped, or open the one an earlier call left in the same state directory
                    bench_run(ctx)
                    results["sync"] = {"skipped": True}
                run_scenario(name, ctx, results)
                # the engine's command line and boot, and the shared-mode hand-overs, as the inference
                # log has them so far (a run cut short keeps them)
                meta["engine_log"] = engine_log.record((stack.logs / "inference.log").read_text(errors="replace"))
                write()
            ctx.client.close()
            ctx.stack, ctx.client = None, None
        finally:
            stack.stop()
    for name in names:
        if name in AFTER_STACK:
            run_scenario(name, ctx, results)
            write()
    results = {k: v for k, v in results.items() if not v.get("skipped")}
    write()
    print(f"\nreport: {out / 'report.md'} ({meta['elapsed_s']:.0f} s)")
    missed = [g["name"] for r in results.values() for g in r.get("goals", []) if not g["met"]]
    failed = [n for n, r in results.items() if r.get("error")]
    if missed:
        print(f"goals missed ({len(missed)}): " + "; ".join(missed))
    if failed:
        print(f"scenarios that failed to run: {failed}")
    return 1 if failed else 0


def last_lines(logs: Path, engine: str, count: int = 15) -> str:
    """The last lines of the engine's own log (what the inference log points at when it fails to boot)."""
    path = logs / f"{'engine' if engine == 'transformers' else engine}.log"
    if not path.is_file():
        return f"(no {path}; the logs are in {logs})"
    tail = path.read_text(errors="replace").splitlines()[-count:]
    return f"--- {path} (last {len(tail)} lines) ---\n" + "\n".join(tail)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def report(meta: dict[str, Any], results: dict[str, Any]) -> str:
    m = meta["machine"]
    hw = f"{m['cpu']}, {m['cpu_count']} cores, {m.get('memory_gib', '?')} GiB" + (
        f"; GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else "; no GPU")
    versions = ", ".join(f"{k} {v}" for k, v in meta["packages"].items())
    lines = [
        f"# tandem benchmark report ({meta['timestamp']})", "",
        f"- **command**: `python bench/suite.py{' --quick' if meta['quick'] else ''}"
        f"{' --engine ' + meta['engine'] + ' --shape ' + meta['shape'] if meta['engine'] != 'transformers' else ''}"
        f"{' --mode shared' if meta['mode'] == 'shared' else ''}`",
        f"- **engine**: {meta['engine']} ({meta['mode']}); model `{meta['model']}` ({meta['shape']})",
        f"- **hardware**: {hw}",
        f"- **software**: Python {m['python']}, {m['platform']}; {versions}; {m.get('redis_server', '')}",
    ]
    for key, name in (("sglang_env", "SGLang"), ("vllm_env", "vLLM"), ("trainer_env", "trainer")):
        if meta.get(key):
            lines.append(f"- **{name} environment**: {meta[key]}")
    if meta.get("sglang_patches"):
        lines.append(f"- **tandem's SGLang patches**: {meta['sglang_patches']}")
    if (meta.get("engine_log") or {}).get("engine_command"):
        lines.append(f"- **engine command**: `{meta['engine_log']['engine_command']}`")
    lines += [f"- **settings**: `{json.dumps(meta['settings'])}`", f"- **wall time**: {meta['elapsed_s']:.0f} s", ""]
    goals = [(r["title"], g) for r in results.values() for g in r.get("goals", [])]
    if goals:
        lines += ["## Goals", "", md_table(
            ["scenario", "goal", "value", "target", "verdict"],
            [[t, g["name"], g["value"], f"{'≤' if g['at_most'] else '≥'} {g['target']}",
              "met" if g["met"] else "**missed**" + (f" ({g['note']})" if g.get("note") else "")]
             for t, g in goals]), ""]
    for r in results.values():
        lines += [f"## {r['title']}", ""]
        if r.get("error"):
            lines += [f"**failed to run**: `{r['error']}`", ""]
            continue
        lines += [r["table"], ""]
        lines += [f"![{p}]({p})" for p in r.get("plots", [])]
        lines += [f"_{r.get('elapsed_s', 0)} s_", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
