"""Scenario 14, many versions through few slots (versions): every answer checked against the
version it was asked for.

64 runs publish 4 versions each (256 versions; quick: 4 runs of 3), published, registered and
announced with `adapter_ready` as the trainer does (`tandem.dev.versions`). Each version is a
reseeded copy of one random LoRA of the suite's model (`reseed_adapter`: its lora_B drawn from a
seed of its own), so hundreds of versions cost milliseconds each and every version changes the
outputs in its own way. Then 200 requests (quick: 24), 12 at a time (quick: 4), ask the gateway
for a random `run@vN` or a plain `run` (its newest version), greedily, 3 tokens (8 on GPUs) of
one prompt of token ids. Wherever the versions outnumber the engine's adapter slots (`--engine-slots`; the
suite's 128 hold all 256 of the full size but not 4 x 3 through 4), each pinned older version
needs an on-demand load that evicts another adapter.

Which version answered is checked by its output. Before any of the versions is registered (so the
controller is loading nothing of them), each version asked for is loaded into the same engine the
stack runs, straight through tandem's engine client and by its store path, under a name the
controller does not take for one of its own (`ref-<n>`: it leaves such adapters alone), completes
the prompt greedily, and is unloaded: one at a time, in the one slot that must be free (the
scenario is not run where none is: run it first, `--only versions`). Those references must
differ pairwise: versions whose references are alike could not be told apart, so their requests
are left out of the plan and counted in the report (on the CPU, where the test beside it expects
none, any is a failure of the scenario).

An answer is wrong when its token ids differ from its version's reference, or the gateway states
another version (the body's `tandem.version` or the `x-tandem-version` header). Logprobs: on the
CPU (the transformers engine, float32, one batch at a time) they must also lie within 1e-3 of the
reference, as in tests/integration/test_engine_capacity.py; on GPUs (bfloat16, batched with
whatever else runs) the largest |difference| is reported, not judged: the token ids are the
criterion there, and the references must differ in them. Goals: 0 failed requests, 0 wrong answers,
and at least 90 % of the planned requests checked (not left out as alike). Reported beside them: the
engine's slots and whether the versions exceeded them, the gateway's on-demand loads and evictions
during the requests (its /metrics), and wall times. The runs are deleted afterwards, so that later
scenarios find the slots free.
"""

from __future__ import annotations

import asyncio
import functools
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.benchlib import Ctx, goal, md_table
from bench.scenarios.density import delete_runs
from tandem.acl import Role
from tandem.adapters import AdapterStore, Manifest
from tandem.dev.metrics import metric
from tandem.dev.versions import announce_ready, publish_version
from tandem.events import EventKind, EventStream
from tandem.registry import Registry
from tandem.runs import LoraConfig, RunSpec, parse_adapter_name
from tandem.settings import EngineSettings
from tandem_inference.engines import connect
from tandem_inference.engines.base import Engine, Sampling

PROMPT = [11, 23, 5, 42, 7]
MAX_TOKENS = 3
#: On GPUs the token ids alone tell versions apart: more of them make two versions' references alike less often.
GPU_MAX_TOKENS = 8
#: Versions whose references are alike are left out; past this share left out the check says too little.
MIN_CHECKED = 0.9
RANK = 8
TARGETS = ("q_proj", "v_proj")
#: Logprobs of the CPU engine against its own references (float32, one batch at a time).
CPU_LOGPROB_TOLERANCE = 1e-3
LOAD_TIMEOUT_S = 600.0
METRICS = {"loads": "tandem_adapter_on_demand_loads_total", "evictions": "tandem_adapter_evictions_total"}

Reference = tuple[list[int], list[float]]


@dataclass
class Size:
    runs: int
    versions: int
    requests: int
    concurrency: int
    max_tokens: int


@dataclass
class Checked:
    """What the requests got, against the references."""

    failed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    logprob_max_diff: float = 0.0


def size(ctx: Ctx) -> Size:
    max_tokens = MAX_TOKENS if ctx.engine == "transformers" else GPU_MAX_TOKENS
    return Size(4, 3, 24, 4, max_tokens) if ctx.quick else Size(64, 4, 200, 12, max_tokens)


def engine_settings(ctx: Ctx) -> EngineSettings:
    """The stack's engine as the gateway talks to it: its kind, URL, admin key and slots."""
    assert ctx.stack is not None
    env = ctx.stack.env()
    return EngineSettings(kind=env.get("TANDEM_ENGINE__KIND", "transformers"), url=ctx.stack.engine_url,
                          admin_api_key=env["TANDEM_ENGINE__ADMIN_API_KEY"], model=ctx.model,
                          served_model_name=ctx.served_model,
                          max_loaded_adapters=int(env.get("TANDEM_ENGINE__MAX_LOADED_ADAPTERS", "8")))


def reference_name(n: int) -> str:
    """`ref-<n>`: a name the controller does not parse as one of its adapters (it leaves it alone)."""
    name = f"ref-{n}"
    if parse_adapter_name(name) is not None:
        raise AssertionError(f"{name!r} parses as a tandem adapter name: the controller would unload it")
    return name


async def free_slots(settings: EngineSettings) -> tuple[int, int]:
    """(adapters the engine holds, its slots)."""
    async with httpx.AsyncClient(timeout=60) as http:
        held = await connect(settings, http).loaded_adapters()
    return len(held), settings.max_loaded_adapters


async def references(settings: EngineSettings, store: AdapterStore, asked: list[Manifest],
                     max_tokens: int) -> dict[tuple[str, int], Reference]:
    """Each version's greedy completion of PROMPT from the stack's engine, loaded alone by path."""
    out: dict[tuple[str, int], Reference] = {}
    async with httpx.AsyncClient(timeout=600) as http:
        engine: Engine = connect(settings, http)
        for n, m in enumerate(asked):
            name = reference_name(n)
            await engine.load_adapter(name, str(store.adapter_dir(m.run, m.version)))
            try:
                (gen,) = await engine.complete(PROMPT, Sampling(max_tokens=max_tokens, temperature=0), adapter=name)
            finally:
                await engine.unload_adapter(name)
            out[(m.run, m.version)] = (list(gen.token_ids), list(gen.logprobs or []))
    return out


def indistinct(refs: dict[tuple[str, int], Reference], *, ids_only: bool) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """Pairs of versions whose references are alike (by token ids alone where `ids_only`)."""
    seen: dict[Any, tuple[str, int]] = {}
    alike = []
    for key, (ids, logprobs) in sorted(refs.items()):
        sig = tuple(ids) if ids_only else (tuple(ids), tuple(round(lp, 3) for lp in logprobs))
        if sig in seen:
            alike.append((seen[sig], key))
        seen.setdefault(sig, key)
    return alike


def named(pair: tuple[tuple[str, int], tuple[str, int]]) -> str:
    (run_a, v_a), (run_b, v_b) = pair
    return f"{run_a}@v{v_a} and {run_b}@v{v_b}"


def publish_all(ctx: Ctx, store: AdapterStore, template: Path, sz: Size) -> list[Manifest]:
    """The runs (created as a client does), and their versions in the store, not yet registered."""
    assert ctx.client is not None
    manifests = []
    for i in range(sz.runs):
        run = f"vers-{i:02d}-{ctx.call}"
        ctx.client.registry.create_run(RunSpec(name=run, base_model=ctx.model,
                                               lora=LoraConfig(r=RANK, alpha=2 * RANK, target_modules=TARGETS)))
        for version in range(1, sz.versions + 1):
            seed = 1000 + i * sz.versions + version
            manifests.append(publish_version(store, run, version, base_model=ctx.model, rank=RANK,
                                             write=functools.partial(reseed, template, seed=seed)))
    return manifests


def reseed(template: Path, out: Path, seed: int) -> Path:
    from tandem_trainer.tiny_model import reseed_adapter

    written: Path = reseed_adapter(template, out, seed)
    return written


def register_and_announce(ctx: Ctx, store: AdapterStore, manifests: list[Manifest], runs: list[str]) -> float:
    """Register and announce every version as the trainer does (its Redis role); wait until each run's
    newest version was loaded. Returns the seconds that took."""
    assert ctx.stack is not None and ctx.client is not None
    conn = redis.Redis.from_url(ctx.stack.redis_urls[Role.TRAINER])
    registry, events = Registry(conn), EventStream(conn)
    t0 = time.time()
    for m in manifests:
        registry.register_version(m)
        announce_ready(events, store, m)
    newest = {m.run: m.version for m in manifests}
    deadline = time.time() + LOAD_TIMEOUT_S
    while True:
        loaded = {(e.run, e.version) for e in ctx.client.events.since(t0 - 1) if e.kind is EventKind.ADAPTER_LOADED}
        missing = [run for run in runs if (run, newest[run]) not in loaded]
        if not missing:
            return time.time() - t0
        if time.time() > deadline:
            raise RuntimeError(f"{len(missing)} runs' newest versions were not loaded within {LOAD_TIMEOUT_S:.0f} s "
                               f"(e.g. {missing[:3]}); the inference log says why")
        time.sleep(0.2)


async def send(url: str, plan: list[tuple[str, int | None]], concurrency: int,
               max_tokens: int) -> list[httpx.Response | str]:
    """Every request of `plan` (run, pinned version or None), `concurrency` at a time: the response, or
    the error that kept it from coming back."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(run: str, version: int | None) -> httpx.Response | str:
            model = run if version is None else f"{run}@v{version}"
            body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
            async with gate:
                try:
                    return await http.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    return f"{type(exc).__name__}: {exc}"

        return await asyncio.gather(*(one(run, version) for run, version in plan))


def check(plan: list[tuple[str, int | None]], replies: list[httpx.Response | str],
          refs: dict[tuple[str, int], Reference], newest: dict[str, int], tolerance: float | None) -> Checked:
    """Failed requests, and answers that are not their version's (`tolerance`: also by logprobs)."""
    out = Checked()
    for (run, pinned), reply in zip(plan, replies, strict=True):
        model = run if pinned is None else f"{run}@v{pinned}"
        if isinstance(reply, str) or reply.status_code != 200:
            out.failed.append(f"{model}: {reply if isinstance(reply, str) else f'{reply.status_code} {reply.text[:200]}'}")
            continue
        version = newest[run] if pinned is None else pinned
        answer = reply.json()["tandem"]
        (ids,), (logprobs,) = answer["completion_token_ids"], answer["completion_logprobs"]
        ref_ids, ref_logprobs = refs[(run, version)]
        diff = max((abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=False)), default=0.0)
        out.logprob_max_diff = max(out.logprob_max_diff, diff)
        stated = {answer.get("version"), int(reply.headers.get("x-tandem-version", -1))}
        if ids != ref_ids or stated != {version} or (tolerance is not None and diff > tolerance):
            out.wrong.append(f"{model}: v{sorted(stated, key=str)} gave {ids} (logprob diff {diff:.2g}), "
                             f"v{version}'s reference {ref_ids}")
    return out


def not_run(reason: str) -> dict[str, Any]:
    return {"name": "versions", "title": "14. Many versions through few slots", "summary": {"not_run": reason},
            "rows": [], "goals": [], "table": f"**not run**: {reason}", "plots": []}


def run(ctx: Ctx) -> dict[str, Any]:
    assert ctx.stack is not None and ctx.client is not None
    t_start = time.time()
    sz = size(ctx)
    settings = engine_settings(ctx)
    held, slots = asyncio.run(free_slots(settings))
    if held >= slots:
        return not_run(f"all {slots} of the engine's adapter slots are taken (it holds {held}), none free for the "
                       "references (each version is loaded alone beside what it holds): run it first, "
                       "`--only versions`")
    store = AdapterStore(ctx.store_root)
    with tempfile.TemporaryDirectory() as tmp:
        from tandem_trainer.tiny_model import build_random_adapter

        template = build_random_adapter(ctx.model, Path(tmp) / "template", rank=RANK, seed=0, target_modules=TARGETS)
        manifests = publish_all(ctx, store, template, sz)
    runs = sorted({m.run for m in manifests})
    try:
        return measure(ctx, settings, store, manifests, runs, sz, slots, t_start)
    finally:
        ctx.progress(f"deleted {delete_runs(ctx, runs)} of {len(runs)} runs")


def measure(ctx: Ctx, settings: EngineSettings, store: AdapterStore, manifests: list[Manifest], runs: list[str],
            sz: Size, slots: int, t_start: float) -> dict[str, Any]:
    assert ctx.stack is not None
    gpu = settings.kind != "transformers"
    newest = {m.run: m.version for m in manifests}
    rng = random.Random(7)
    plan: list[tuple[str, int | None]] = [
        (rng.choice(runs), None if rng.random() < 0.2 else rng.randint(1, sz.versions)) for _ in range(sz.requests)]
    asked_keys = {(run, newest[run] if v is None else v) for run, v in plan}
    asked = [m for m in manifests if (m.run, m.version) in asked_keys]
    ctx.progress(f"{len(manifests)} versions of {len(runs)} runs published; references of the {len(asked)} asked for ...")
    t0 = time.time()
    refs = asyncio.run(references(settings, store, asked, sz.max_tokens))
    refs_s = time.time() - t0
    alike = indistinct(refs, ids_only=gpu)
    if alike and not gpu:
        raise RuntimeError(f"{len(alike)} pairs of versions complete the prompt alike "
                           f"({'; '.join(named(p) for p in alike[:3])}): the scenario could not tell them apart")
    untold = {key for pair in alike for key in pair}  # left out: an answer of either would pass for the other
    plan = [(run, v) for run, v in plan if (run, newest[run] if v is None else v) not in untold]
    if alike:
        ctx.progress(f"{len(untold)} versions complete the prompt alike ({named(alike[0])}, ...): their requests "
                     "are left out")
    announced_s = register_and_announce(ctx, store, manifests, runs)
    ctx.progress(f"registered and announced; every run's newest version loaded in {announced_s:.1f} s")
    before = {k: metric(ctx.stack.gateway_url, name) for k, name in METRICS.items()}
    t0 = time.time()
    replies = asyncio.run(send(ctx.stack.gateway_url, plan, sz.concurrency, sz.max_tokens))
    requests_s = time.time() - t0
    counted = {k: metric(ctx.stack.gateway_url, name) - before[k] for k, name in METRICS.items()}
    checked = check(plan, replies, refs, newest, None if gpu else CPU_LOGPROB_TOLERANCE)
    summary: dict[str, Any] = {
        "runs": len(runs), "versions": len(manifests), "engine_slots": slots, "exceeded": len(manifests) > slots,
        "requests": len(plan), "requests_planned": sz.requests, "concurrency": sz.concurrency,
        "versions_asked": len({(run, newest[run] if v is None else v) for run, v in plan}),
        "versions_alike": len(untold), "alike_examples": [named(p) for p in alike[:3]], "max_tokens": sz.max_tokens,
        "failed": len(checked.failed), "failed_examples": checked.failed[:3], "wrong": len(checked.wrong),
        "wrong_examples": checked.wrong[:3], "logprob_max_diff": checked.logprob_max_diff,
        "logprob_tolerance": None if gpu else CPU_LOGPROB_TOLERANCE, "references_distinct": not alike,
        "on_demand_loads": counted["loads"], "evictions": counted["evictions"], "references_s": refs_s,
        "announce_to_loaded_s": announced_s, "requests_s": requests_s, "wall_s": time.time() - t_start,
    }
    ctx.progress(f"{summary['failed']} failed, {summary['wrong']} wrong of {len(plan)}; "
                 f"{counted['loads']:.0f} on-demand loads, {counted['evictions']:.0f} evictions")
    return {"name": "versions", "title": "14. Many versions through few slots", "summary": summary, "rows": [summary],
            "goals": [goal("failed requests", float(summary["failed"]), 0.0),
                      goal("answers not from the version asked for", float(summary["wrong"]), 0.0),
                      goal("share of the planned requests checked (not left out as alike)",
                           len(plan) / sz.requests, MIN_CHECKED, at_most=False)],
            "table": table_of(summary, gpu), "plots": []}


def table_of(s: dict[str, Any], gpu: bool) -> str:
    table = md_table(
        ["runs x versions", "engine slots", "versions > slots", "requests (at once)", "failed", "wrong version",
         "logprob max |diff|", "on-demand loads", "evictions", "requests s", "wall s"],
        [[f"{s['runs']} x {s['versions'] // s['runs']}", s["engine_slots"], "yes" if s["exceeded"] else "no",
          f"{s['requests']} ({s['concurrency']})", s["failed"], s["wrong"], f"{s['logprob_max_diff']:.2g}",
          int(s["on_demand_loads"]), int(s["evictions"]), s["requests_s"], s["wall_s"]]])
    table += (f"\n\nEach request: a random run, pinned to a random version or (1 in 5) plain, greedy, "
              f"{s['max_tokens']} tokens; each answer against the reference of its version ({s['versions_asked']} asked "
              "for), computed beforehand by the same engine with that version loaded alone, by path. ")
    table += ("On GPUs the token ids decide (the references differ in them); the logprob difference is reported, "
              "not judged." if gpu else
              f"Token ids must match and logprobs lie within {CPU_LOGPROB_TOLERANCE:g} of the reference.")
    if s["versions_alike"]:
        table += (f" {s['versions_alike']} versions completed the prompt alike (e.g. {s['alike_examples'][0]}): "
                  "their requests were left out, as an answer of one would pass for the other.")
    if not s["exceeded"]:
        table += (f" The engine's {s['engine_slots']} slots held every version here: run it with fewer "
                  "(`--engine-slots 8`) to make versions cycle through the slots.")
    for label, key in (("Failed", "failed_examples"), ("Wrong", "wrong_examples")):
        if s[key]:
            table += f"\n\n{label}, e.g.: " + "; ".join(s[key])
    return table
