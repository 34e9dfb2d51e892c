"""The hot-load scenario's measurements: (a) hot-load, (b) restart and (c) merge + reload, each
until the first response, against one engine (hotload_engine.Engine).

Order: the base model's first response, one warm-up hot-load, K hot-loads, the merges, then the
restarts (a restart brings the original base weights back). Hot-loaded adapters are unloaded
once two newer ones are loaded, as the controller does. A step that fails is a row with its
error; the other steps go on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.hotload.hotload_adapters import rank, run_merge
from bench.hotload.hotload_engine import Engine
from tandem_inference.engines.base import Sampling

PROMPT_IDS = list(range(100, 116))  # valid in any vocabulary of 116+ tokens; no tokenizer needed here
FIRST_RESPONSE = Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)
KEEP_LOADED = 2  # hot-loaded adapters kept loaded (the controller's default keep_versions)


async def measure(ctx: Any, adapters: list[Path], k: int, restarts: int, merges: int,
                  merge_python: str) -> list[dict[str, Any]]:
    import httpx

    from tandem_inference.errors import EngineBootError, EngineClientError

    rows: list[dict[str, Any]] = []
    refs: dict[Path, dict[str, Any]] = {}  # adapter -> its first response in (a)
    loaded: list[str] = []
    names = iter(f"hotload-{i}" for i in range(1_000_000))
    async with httpx.AsyncClient() as http:
        engine = Engine(ctx, http, max(rank(a) for a in adapters))
        try:
            ctx.progress("hotload: starting the engine ...")
            boot_s = await engine.start()
            ctx.progress(f"hotload: engine healthy in {boot_s:.1f} s (log: {engine.log_path})")
            t0 = time.perf_counter()
            base_ref = await _first(engine)
            rows.append({"approach": "base", "i": 0, "first_response_ms": ms_since(t0), "total_ms": ms_since(t0)})

            # (a) hot-load: one warm-up, then k measured
            for i in range(k + 1):
                path = adapters[(i - 1) % len(adapters)] if i else adapters[0]
                what = "warm-up hot-load" if i == 0 else f"hot-load {i}/{k}"
                try:
                    row, answer = await _hotload(engine, next(names), path)
                except EngineClientError as exc:
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
                    except EngineClientError as exc:
                        ctx.progress(f"hotload: unload of {old} failed ({exc}); it stays loaded")

            # (c) merge + reload
            for j in range(1, merges + 1):
                path = adapters[(j - 1) % len(adapters)]
                try:
                    rows.append(await _merge_reload(ctx, engine, path, j, merges, merge_python, refs.get(path),
                                                    base_ref))
                except (EngineClientError, subprocess.SubprocessError, ValueError, KeyError) as exc:
                    rows.append({"approach": "merge-reload", "i": j, "adapter": str(path),
                                 "error": f"{type(exc).__name__}: {exc}"})
                    ctx.progress(f"hotload: merge {j}/{merges} failed: {exc}")

            # (b) restart
            for r in range(1, restarts + 1):
                path = adapters[(r - 1) % len(adapters)]
                try:
                    row = await _restart(ctx, engine, next(names), path, f"restart {r}/{restarts}")
                except (EngineClientError, EngineBootError) as exc:
                    rows.append({"approach": "restart", "i": r, "adapter": str(path), "error": str(exc)})
                    ctx.progress(f"hotload: restart {r}/{restarts} failed: {exc}")
                    break  # the engine is down or broken: later restarts would measure the failure again
                answer, ref = row.pop("answer"), refs.get(path)
                row["same_tokens_as_hotload"] = None if ref is None else answer["ids"] == ref["ids"]
                rows.append({"i": r, **row})
        finally:
            engine.stop()
    return rows


async def _hotload(engine: Engine, name: str, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a): load the adapter under a new name, then its first response."""
    t0 = time.perf_counter()
    await engine.client.load_adapter(name, str(path))
    t1 = time.perf_counter()
    answer = await _first(engine, name)
    t2 = time.perf_counter()
    row = {"approach": "hot-load", "adapter": str(path), "name": name, "load_ms": (t1 - t0) * 1000,
           "first_response_ms": (t2 - t1) * 1000, "total_ms": (t2 - t0) * 1000}
    return row, answer


async def _restart(ctx: Any, engine: Engine, name: str, path: Path, what: str) -> dict[str, Any]:
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


async def _merge_reload(ctx: Any, engine: Engine, adapter: Path, j: int, n: int, merge_python: str,
                        ref: dict[str, Any] | None, base_ref: dict[str, Any]) -> dict[str, Any]:
    from tandem_inference.errors import EngineClientError

    row: dict[str, Any] = {"approach": "merge-reload", "i": j, "adapter": str(adapter)}
    merged = Path(ctx.out) / f"hotload-merged-{j}"
    shutil.rmtree(merged, ignore_errors=True)
    try:
        ctx.progress(f"hotload: merge {j}/{n}: merging {adapter} into the base and saving ...")
        t0 = time.perf_counter()
        proc = run_merge(merge_python, str(ctx.model), adapter, merged)
        row["merge_process_ms"] = ms_since(t0)
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
            await engine.client.update_weights(str(merged))
        except EngineClientError as exc:
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
    row["base_changed"] = answer["ids"] != base_ref["ids"] or max_diff(answer["lps"], base_ref["lps"]) > 1e-6
    if ref is not None:
        row["matches_adapter"] = answer["ids"] == ref["ids"]
        row["max_logprob_diff_vs_adapter"] = max_diff(answer["lps"], ref["lps"])
    ctx.progress(f"hotload: merge {j}/{n}: reload {row['reload_ms']:.1f} ms + first response "
                 f"{row['first_response_ms']:.1f} ms; total {row['total_ms'] / 1000:.2f} s; served weights "
                 f"changed: {row['base_changed']}, answers like the adapter: {row.get('matches_adapter')}")
    return row


async def _first(engine: Engine, adapter: str | None = None) -> dict[str, Any]:
    (out,) = await engine.client.complete(PROMPT_IDS, FIRST_RESPONSE, adapter=adapter)
    return {"ids": out.token_ids, "lps": out.logprobs}


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def max_diff(a: list[float], b: list[float]) -> float:
    """The largest difference between two logprob lists; infinite when their lengths differ."""
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
