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

The merge runs in a subprocess of the first interpreter that imports torch, transformers and
peft (`ctx.trainer_python` when the context has one, then `ctx.tandem_python`, this one,
`ctx.sglang_python`); its time is what loading the base, merging and saving take in that process
(interpreter start and imports are reported apart). Without such an interpreter (c) is reported
as not measured. A step that fails is a row with its error, and the report names it; the other
steps go on. With no published versions in the store, random LoRA adapters (r=16 on the seven
projections) are made first.

    python bench/hotload.py run --quick --out /tmp/hotload        # tiny model, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PROMPT_IDS = list(range(100, 116))  # valid in any vocabulary of 116+ tokens; no tokenizer needed here
FIRST_RESPONSE = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
KEEP_LOADED = 2  # hot-loaded adapters kept loaded (the controller's default keep_versions)
GOAL_RATIO = 100.0
GOAL_NAME = "hot-load ≥ 100× faster than an engine restart"
ENGINE_PORTS = (30000, 31000)  # SGLang derives more ports from its own and refuses high ones
RANDOM_ADAPTER_RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def counts(quick: bool) -> tuple[int, int, int]:
    """(hot-loads, restarts, merges)."""
    return (2, 1, 1) if quick else (5, 2, 2)


def run(ctx: Any) -> dict[str, Any]:
    k, restarts, merges = counts(ctx.quick)
    out = Path(ctx.out)
    out.mkdir(parents=True, exist_ok=True)
    merge_python, why = _merge_python(ctx)
    if merge_python is None:
        ctx.progress(f"hotload: (c) cannot be measured: {why}")
        merges = 0
    adapters = _adapters(ctx, merge_python, max(k, merges))
    ctx.progress(f"hotload: {ctx.engine} engine, model {ctx.model}; {k} hot-loads, {merges} merges, "
                 f"{restarts} restarts over {len(adapters)} adapter(s)")
    rows = asyncio.run(_measure(ctx, adapters, k, restarts, merges, merge_python or ""))
    if merge_python is None:
        rows.append({"approach": "merge-reload", "i": 0, "error": why})
    result = report(ctx, rows, out)
    result["summary"]["merge_python"] = merge_python
    return result


# the measurements -----------------------------------------------------------------------------


class _Engine:
    """One engine process on a free low port, started and stopped as tandem's launcher does."""

    def __init__(self, ctx: Any, http: Any, max_rank: int) -> None:
        self.ctx, self.http, self.max_rank = ctx, http, max_rank
        self._configure(_free_low_port())

    def _configure(self, port: int) -> None:
        from tandem.settings import InferenceSettings
        from tandem_inference.engine_client import EngineClient
        from tandem_inference.launcher import Launcher, sglang_argv, sglang_env

        ctx, http, max_rank = self.ctx, self.http, self.max_rank
        self.port = port
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONUNBUFFERED": "1"})
        if ctx.engine == "transformers":  # one torch thread, as the local stack runs it
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("MKL_NUM_THREADS", "1")
        env.update(ctx.engine_env)
        env.update({
            "TANDEM_ENGINE__KIND": ctx.engine,
            "TANDEM_ENGINE__MODEL": str(ctx.model),
            "TANDEM_ENGINE__URL": f"http://127.0.0.1:{port}",
            "TANDEM_ENGINE__HOST": "127.0.0.1",
            "TANDEM_ENGINE__PORT": str(port),
            "TANDEM_ENGINE__SGLANG_PYTHON": ctx.sglang_python,
            # the engine loads only from its roots: the store's versions or the random adapters in
            # `out`, and the merged checkpoints in `out`
            "TANDEM_ENGINE__ADAPTER_ROOTS": json.dumps([str(Path(ctx.store_root).resolve()), str(Path(ctx.out).resolve())]),
            "TANDEM_ENGINE__WEIGHTS_ROOTS": json.dumps([str(Path(ctx.out).resolve()), str(Path(ctx.model).resolve().parent)]),
        })
        with _environ(env):
            settings = InferenceSettings(_env_file=None)  # type: ignore[call-arg]
        if max_rank > settings.engine.max_lora_rank:
            if not hasattr(self, "launcher"):
                ctx.progress(f"hotload: adapters have rank {max_rank} > engine.max_lora_rank "
                             f"{settings.engine.max_lora_rank}; starting the engine with {max_rank}")
            env["TANDEM_ENGINE__MAX_LORA_RANK"] = str(max_rank)
            with _environ(env):
                settings = InferenceSettings(_env_file=None)  # type: ignore[call-arg]
        if ctx.engine == "sglang":
            argv, env = sglang_argv(settings), sglang_env(settings, base=env)
        else:
            argv = [ctx.tandem_python, "-m", "tandem_inference.engine_server"]
        self.log_path = Path(ctx.out) / "hotload-engine.log"
        self.launcher = Launcher(settings, http, argv=argv, env=env, log_path=self.log_path, health_poll_s=0.05)
        self.client = EngineClient.from_settings(http, settings.engine)

    async def start(self) -> float:
        """Start the engine and wait until /health answers; returns seconds.

        The port is checked first: when another process took it while the engine was down, the
        engine moves to another free one (its /health would otherwise answer for this engine).
        """
        t0 = time.perf_counter()
        if not _port_free(self.port):
            moved = _free_low_port()
            self.ctx.progress(f"hotload: port {self.port} was taken while the engine was down; using {moved}")
            self._configure(moved)
        await self.launcher.start()
        return time.perf_counter() - t0

    def stop(self) -> float:
        """Stop the engine's whole process group and wait until every process of it is gone."""
        t0 = time.perf_counter()
        proc = self.launcher.proc
        self.launcher.terminate()
        if proc is not None:
            _wait_group_gone(proc.pid, timeout_s=60.0)
        return time.perf_counter() - t0


async def _measure(ctx: Any, adapters: list[Path], k: int, restarts: int, merges: int,
                   merge_python: str) -> list[dict[str, Any]]:
    import httpx

    from tandem_inference.errors import EngineError
    from tandem_inference.launcher import EngineBootError

    rows: list[dict[str, Any]] = []
    refs: dict[Path, dict[str, Any]] = {}  # adapter -> its first response in (a)
    loaded: list[str] = []
    names = iter(f"hotload-{i}" for i in range(1_000_000))
    async with httpx.AsyncClient() as http:
        engine = _Engine(ctx, http, max(_rank(a) for a in adapters))
        try:
            ctx.progress("hotload: starting the engine ...")
            boot_s = await engine.start()
            ctx.progress(f"hotload: engine healthy in {boot_s:.1f} s (log: {engine.log_path})")
            t0 = time.perf_counter()
            base_ref = await _first(engine)
            rows.append({"approach": "base", "i": 0, "first_response_ms": _ms(t0), "total_ms": _ms(t0)})

            # (a) hot-load: one warm-up, then k measured
            for i in range(k + 1):
                path = adapters[(i - 1) % len(adapters)] if i else adapters[0]
                what = "warm-up hot-load" if i == 0 else f"hot-load {i}/{k}"
                try:
                    row, answer = await _hotload(engine, next(names), path)
                except EngineError as exc:
                    rows.append({"approach": "hot-load", "i": i, "warmup": i == 0, "adapter": str(path),
                                 "error": str(exc)})
                    ctx.progress(f"hotload: {what} failed: {exc}")
                    continue
                rows.append({"i": i, "warmup": i == 0, **row})
                if i:
                    refs.setdefault(path, answer)
                loaded.append(row["name"])
                ctx.progress(f"hotload: {what}: load {row['load_ms']:.1f} ms + first response "
                             f"{row['first_response_ms']:.1f} ms = {row['total_ms']:.1f} ms")
                while len(loaded) > KEEP_LOADED:
                    old = loaded.pop(0)
                    try:
                        await engine.client.unload_adapter(old)
                    except EngineError as exc:
                        ctx.progress(f"hotload: unload of {old} failed ({exc}); it stays loaded")

            # (c) merge + reload
            for j in range(1, merges + 1):
                path = adapters[(j - 1) % len(adapters)]
                try:
                    rows.append(await _merge_reload(ctx, engine, path, j, merges, merge_python, refs.get(path),
                                                    base_ref))
                except (EngineError, subprocess.SubprocessError, ValueError, KeyError) as exc:
                    rows.append({"approach": "merge-reload", "i": j, "adapter": str(path),
                                 "error": f"{type(exc).__name__}: {exc}"})
                    ctx.progress(f"hotload: merge {j}/{merges} failed: {exc}")

            # (b) restart
            for r in range(1, restarts + 1):
                path = adapters[(r - 1) % len(adapters)]
                try:
                    row = await _restart(ctx, engine, next(names), path, f"restart {r}/{restarts}")
                except (EngineError, EngineBootError) as exc:
                    rows.append({"approach": "restart", "i": r, "adapter": str(path), "error": str(exc)})
                    ctx.progress(f"hotload: restart {r}/{restarts} failed: {exc}")
                    break  # the engine is down or broken: later restarts would measure the failure again
                answer, ref = row.pop("answer"), refs.get(path)
                row["same_tokens_as_hotload"] = None if ref is None else answer["ids"] == ref["ids"]
                rows.append({"i": r, **row})
        finally:
            engine.stop()
    return rows


async def _hotload(engine: _Engine, name: str, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a): load the adapter under a new name, then its first response."""
    t0 = time.perf_counter()
    await engine.client.load_adapter(name, str(path))
    t1 = time.perf_counter()
    answer = await _first(engine, name)
    t2 = time.perf_counter()
    row = {"approach": "hot-load", "adapter": str(path), "name": name, "load_ms": (t1 - t0) * 1000,
           "first_response_ms": (t2 - t1) * 1000, "total_ms": (t2 - t0) * 1000}
    return row, answer


async def _restart(ctx: Any, engine: _Engine, name: str, path: Path, what: str) -> dict[str, Any]:
    """(b): stop the engine, start it, wait for /health, load the adapter, first response."""
    ctx.progress(f"hotload: {what}: stopping the engine ...")
    t0 = time.perf_counter()
    stop_s = engine.stop()
    ctx.progress(f"hotload: {what}: stopped in {stop_s:.1f} s; starting ...")
    boot_s = await engine.start()
    t1 = time.perf_counter()
    await engine.client.load_adapter(name, str(path))
    t2 = time.perf_counter()
    answer = await _first(engine, name)
    t3 = time.perf_counter()
    row = {"approach": "restart", "adapter": str(path), "stop_ms": stop_s * 1000, "boot_ms": boot_s * 1000,
           "load_ms": (t2 - t1) * 1000, "first_response_ms": (t3 - t2) * 1000, "total_ms": (t3 - t0) * 1000,
           "answer": answer}
    ctx.progress(f"hotload: {what}: stop {stop_s:.1f} s + boot {boot_s:.1f} s + load {row['load_ms']:.1f} ms "
                 f"+ first response {row['first_response_ms']:.1f} ms = {row['total_ms'] / 1000:.2f} s")
    return row


async def _merge_reload(ctx: Any, engine: _Engine, adapter: Path, j: int, n: int, merge_python: str,
                        ref: dict[str, Any] | None, base_ref: dict[str, Any]) -> dict[str, Any]:
    from tandem_inference.errors import EngineError

    row: dict[str, Any] = {"approach": "merge-reload", "i": j, "adapter": str(adapter)}
    merged = Path(ctx.out) / f"hotload-merged-{j}"
    shutil.rmtree(merged, ignore_errors=True)
    try:
        ctx.progress(f"hotload: merge {j}/{n}: merging {adapter} into the base and saving ...")
        t0 = time.perf_counter()
        proc = subprocess.run(
            [merge_python, str(Path(__file__).resolve()), "merge", "--base", str(ctx.model),
             "--adapter", str(adapter), "--out", str(merged)],
            capture_output=True, text=True, timeout=3600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        row["merge_process_ms"] = _ms(t0)
        if proc.returncode != 0:
            row["error"] = f"merge failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}"
            ctx.progress(f"hotload: merge {j}/{n}: {row['error']}")
            return row
        timing = json.loads(proc.stdout.strip().splitlines()[-1])
        row["merge_save_ms"] = timing["merge_save_ms"]
        row["merge_imports_ms"] = timing["imports_ms"]
        ctx.progress(f"hotload: merge {j}/{n}: merge + save {row['merge_save_ms'] / 1000:.2f} s "
                     f"(process {row['merge_process_ms'] / 1000:.2f} s with interpreter start and imports); "
                     "reloading ...")
        t1 = time.perf_counter()
        try:
            await engine.client.update_weights_from_disk(str(merged))
        except EngineError as exc:
            row["error"] = f"/update_weights_from_disk failed: {exc}"
            ctx.progress(f"hotload: merge {j}/{n}: {row['error']}")
            return row
        t2 = time.perf_counter()
        answer = await _first(engine)
        t3 = time.perf_counter()
    finally:
        shutil.rmtree(merged, ignore_errors=True)
    row.update({"reload_ms": (t2 - t1) * 1000, "first_response_ms": (t3 - t2) * 1000})
    row["total_ms"] = row["merge_save_ms"] + row["reload_ms"] + row["first_response_ms"]
    row["base_changed"] = answer["ids"] != base_ref["ids"] or _max_diff(answer["lps"], base_ref["lps"]) > 1e-6
    if ref is not None:
        row["matches_adapter"] = answer["ids"] == ref["ids"]
        row["max_logprob_diff_vs_adapter"] = _max_diff(answer["lps"], ref["lps"])
    ctx.progress(f"hotload: merge {j}/{n}: reload {row['reload_ms']:.1f} ms + first response "
                 f"{row['first_response_ms']:.1f} ms; total {row['total_ms'] / 1000:.2f} s; served weights "
                 f"changed: {row['base_changed']}, answers like the adapter: {row.get('matches_adapter')}")
    return row


async def _first(engine: _Engine, adapter: str | None = None) -> dict[str, Any]:
    out = await engine.client.generate(PROMPT_IDS, dict(FIRST_RESPONSE), adapter, True)
    lps = [float(t[0]) for t in out.get("meta_info", {}).get("output_token_logprobs") or []]
    return {"ids": list(out.get("output_ids") or []), "lps": lps}


# the report -----------------------------------------------------------------------------------

PARTS = {
    "hot-load": [("load_ms", "load"), ("first_response_ms", "first response")],
    "restart": [("stop_ms", "stop"), ("boot_ms", "boot"), ("load_ms", "load"), ("first_response_ms", "first response")],
    "merge-reload": [("merge_save_ms", "merge + save"), ("reload_ms", "reload"), ("first_response_ms", "first response")],
}
LABELS = {"hot-load": "(a) hot-load", "restart": "(b) restart", "merge-reload": "(c) merge + reload"}


def report(ctx: Any, rows: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """The scenario's result: summary, rows, goal, markdown table and the plot."""
    measured = {a: [r for r in rows if r["approach"] == a and not r.get("warmup") and "total_ms" in r]
                for a in PARTS}
    p50 = {a: _p50([r["total_ms"] for r in rs]) for a, rs in measured.items()}
    parts = {a: {label: _p50([r[key] for r in measured[a]]) for key, label in PARTS[a]} for a in PARTS}
    hot = p50["hot-load"]
    ratio = {a: (p50[a] / hot if hot and p50[a] is not None else None) for a in ("restart", "merge-reload")}
    merged = measured["merge-reload"]
    errors = [f"{r['approach']} {r['i']}: {r['error']}" for r in rows if r.get("error")]
    warmup = next((r for r in rows if r.get("warmup")), None)
    summary: dict[str, Any] = {
        "engine": ctx.engine,
        "model": str(ctx.model),
        "hotloads": len(measured["hot-load"]),
        "restarts": len(measured["restart"]),
        "merges": len(merged),
        "hotload_total_ms_p50": hot,
        "hotload_load_ms_p50": parts["hot-load"]["load"],
        "hotload_first_response_ms_p50": parts["hot-load"]["first response"],
        "hotload_warmup_total_ms": warmup.get("total_ms") if warmup else None,
        "restart_total_ms_p50": p50["restart"],
        "restart_stop_ms_p50": parts["restart"]["stop"],
        "restart_boot_ms_p50": parts["restart"]["boot"],
        "restart_load_ms_p50": parts["restart"]["load"],
        "restart_first_response_ms_p50": parts["restart"]["first response"],
        "merge_total_ms_p50": p50["merge-reload"],
        "merge_save_ms_p50": parts["merge-reload"]["merge + save"],
        "merge_reload_ms_p50": parts["merge-reload"]["reload"],
        "merge_first_response_ms_p50": parts["merge-reload"]["first response"],
        "merge_process_ms_p50": _p50([r["merge_process_ms"] for r in merged]),
        "restart_over_hotload": ratio["restart"],
        "merge_over_hotload": ratio["merge-reload"],
        "merged_changed_served_weights": all(r["base_changed"] for r in merged) if merged else None,
        "merged_answers_like_adapter": all(r.get("matches_adapter") for r in merged) if merged else None,
        "errors": errors,
    }
    note = ""
    if ctx.engine != "sglang":
        note = "the goal is stated for SGLang on a GPU; this run used the transformers engine"
    if ratio["restart"] is None:
        note = "; ".join(filter(None, [note, "not measured: " + ("; ".join(errors) or "no restart or hot-load")]))
    goals = [{"name": GOAL_NAME, "value": None if ratio["restart"] is None else round(ratio["restart"], 1),
              "target": GOAL_RATIO, "at_most": False, "met": bool(ratio["restart"] and ratio["restart"] >= GOAL_RATIO),
              "note": note}]
    plots = ["hotload.png"] if plot(out / "hotload.png", parts, p50, ratio, ctx.engine) else []
    return {"name": "hotload", "title": "Hot-load against the alternatives", "summary": summary, "rows": rows,
            "goals": goals, "table": table(measured, p50, parts, ratio, warmup, errors), "plots": plots}


def table(measured: dict[str, list[dict[str, Any]]], p50: dict[str, float | None],
          parts: dict[str, dict[str, float | None]], ratio: dict[str, float | None],
          warmup: dict[str, Any] | None, errors: list[str]) -> str:
    lines = ["| approach | n | p50 total ms | parts, p50 ms each | × hot-load |", "|---|---|---|---|---|"]
    for a in PARTS:
        x = "1" if a == "hot-load" else _num(ratio[a])
        shown = " · ".join(f"{label} {_num(ms)}" for label, ms in parts[a].items())
        lines.append(f"| {LABELS[a]} | {len(measured[a])} | {_num(p50[a])} | {shown} | {x} |")
    if warmup and "total_ms" in warmup:
        lines.append(f"| first hot-load (warm-up, not in the p50) | 1 | {_num(warmup['total_ms'])} | load "
                     f"{_num(warmup['load_ms'])} · first response {_num(warmup['first_response_ms'])} | – |")
    lines += [""] + [f"Not measured: {e}" for e in errors] if errors else []
    return "\n".join(lines)


def plot(path: Path, parts: dict[str, dict[str, float | None]], p50: dict[str, float | None],
         ratio: dict[str, float | None], engine: str) -> bool:
    """Stacked bars of the p50 parts on a log scale, total and ratio on top; False without matplotlib.

    Each bar stacks its parts largest first: on a log scale a part drawn above a larger one
    gets a band about as thin as its share, so the picture does not overstate small parts.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {"load": "#4c72b0", "first response": "#55a868", "stop": "#8172b2", "boot": "#c44e52",
              "merge + save": "#dd8452", "reload": "#937860"}
    values = [ms for segs in parts.values() for ms in segs.values() if ms]
    if not values:
        return False
    floor = min(values) / 3
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    seen: set[str] = set()
    for x, (approach, segs) in enumerate(parts.items()):
        bottom = floor
        for label, ms in sorted(segs.items(), key=lambda kv: -(kv[1] or 0)):
            if not ms:
                continue
            ax.bar(x, ms, bottom=bottom, width=0.6, color=colors[label], label=None if label in seen else label)
            seen.add(label)
            bottom += ms
        if p50[approach] is not None:
            times = "" if approach == "hot-load" else f"\n{ratio[approach]:,.0f}× hot-load"
            ax.text(x, bottom * 1.15, f"{_num(p50[approach])} ms{times}", ha="center", va="bottom", fontsize=9)
    ax.set_yscale("log")
    ax.set_ylim(floor, max(values) * 40)
    ax.set_xticks(range(len(parts)), [LABELS[a] for a in parts])
    ax.set_ylabel("ms until the new policy answers (p50 parts, log scale)")
    ax.set_title(f"Hot-load against the alternatives ({engine} engine)")
    ax.legend(loc="upper left", fontsize=8, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# adapters and the merge -----------------------------------------------------------------------


def _adapters(ctx: Any, merge_python: str | None, wanted: int) -> list[Path]:
    """The newest `wanted` published versions of the run; random adapters when there are none."""
    from tandem.adapters import AdapterStore

    store = AdapterStore(ctx.store_root)
    versions = store.versions(ctx.run_name)[-wanted:]
    if versions:
        return [store.adapter_dir(ctx.run_name, v) for v in versions]
    target = Path(ctx.out) / "hotload-adapters"
    if merge_python is None:
        raise RuntimeError(f"no published versions of run {ctx.run_name!r} under {ctx.store_root}, and no "
                           "interpreter with torch, transformers and peft to make adapters with")
    ctx.progress(f"hotload: no published versions of run {ctx.run_name!r} under {ctx.store_root}; "
                 f"making {min(wanted, 2)} random LoRA adapters (r={RANDOM_ADAPTER_RANK}) in {target}")
    proc = subprocess.run(
        [merge_python, str(Path(__file__).resolve()), "adapters", "--base", str(ctx.model), "--out", str(target),
         "--count", str(min(wanted, 2))],
        capture_output=True, text=True, timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"making adapters with {merge_python} failed: {proc.stderr.strip()[-800:]}")
    return sorted(p for p in target.iterdir() if (p / "adapter_config.json").is_file())


def _merge_python(ctx: Any) -> tuple[str | None, str]:
    """The first interpreter that imports torch, transformers and peft, or None and why not.

    Tried in order: ctx.trainer_python (when the context has one), ctx.tandem_python, this
    interpreter, ctx.sglang_python. On a GPU machine tandem's own environment may hold no torch.
    """
    tried = []
    for python in dict.fromkeys(filter(None, [getattr(ctx, "trainer_python", None), ctx.tandem_python,
                                              sys.executable, ctx.sglang_python])):
        try:
            proc = subprocess.run([python, "-c", "import torch, transformers, peft"], capture_output=True,
                                  text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{python}: {exc}")
            continue
        if proc.returncode == 0:
            return python, ""
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        tried.append(f"{python}: {last}")
    return None, ("the merge needs an interpreter with torch, transformers and peft (give the trainer's as "
                  f"ctx.trainer_python); tried {'; '.join(tried)}")


def merge(base: str, adapter: str, out: str) -> dict[str, float]:
    """Merge `adapter` into `base` and save the full model (config, weights, tokenizer) to `out`."""
    t0 = time.perf_counter()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    for f in Path(base).iterdir():  # a complete model directory: the tokenizer files come along
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy2(f, Path(out) / f.name)
    return {"imports_ms": (t1 - t0) * 1000, "merge_save_ms": (time.perf_counter() - t1) * 1000}


def make_adapters(base: str, out: str, count: int) -> None:
    """`count` random LoRA adapters whose B matrices are nonzero, so each changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    r = RANDOM_ADAPTER_RANK
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS))
    for i in range(1, count + 1):
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        model.save_pretrained(Path(out) / f"v{i:06d}")


# helpers --------------------------------------------------------------------------------------


def _rank(adapter: Path) -> int:
    config = json.loads((adapter / "adapter_config.json").read_text())
    return max([int(config.get("r", 0)), *map(int, (config.get("rank_pattern") or {}).values())])


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _p50(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _num(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2f}"


def _max_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """os.environ replaced by `env` for the block: settings are read from the environment."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _port_free(port: int) -> bool:
    """Whether nothing listens on the port (connections of a stopped server in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_low_port() -> int:
    """A free port in ENGINE_PORTS, picked at random: other tandem stacks take the lowest free one."""
    ports = list(range(*ENGINE_PORTS))
    random.shuffle(ports)
    for port in ports:
        if _port_free(port):
            return port
    raise RuntimeError(f"no free port in {ENGINE_PORTS[0]}-{ENGINE_PORTS[1]} for the engine")


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no live process is left in the group (SGLang's children hold GPU memory until then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _group_members(pgid):
            return
        time.sleep(0.05)
    for pid in _group_members(pgid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc; elsewhere, whether killpg finds any."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="the scenario on its own")
    p_run.add_argument("--quick", action="store_true")
    p_run.add_argument("--out", default=None, help="default: bench/results/hotload-<timestamp>")
    p_run.add_argument("--model", default=None, help="default: the tiny model (built if needed)")
    p_run.add_argument("--engine", choices=["transformers", "sglang"], default="transformers")
    p_run.add_argument("--store", default=None, help="adapter store root (default: random adapters)")
    p_run.add_argument("--run-name", default="bench")
    p_run.add_argument("--tandem-python", default=sys.executable)
    p_run.add_argument("--sglang-python", default="python3")
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
        sglang_python=args.sglang_python, trainer_python=args.trainer_python, engine_env=json.loads(args.engine_env),
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
