"""Scenario 12, many runs on one base (density): 1, 8 and 32 runs of the same base model, each
a client of its own doing rollouts and train steps at once, on one engine and one trainer.

Each run is a thread with its own `Run` (one `Client` shared by them) that does the toy task's
steps pipelined (`max_staleness_steps` 1: the rollouts of step k+1 go on while step k trains):
four prompts a step, a group of 8 completions each through the gateway, then `train(wait=False)`;
after its last step it waits until its last version serves. Every run of a count starts at the
same moment. A prober per run (scenario 1's) sends one-token requests from each `adapter_ready`
of the run until the new version (or a newer one: the controller skips a version that a newer one
of its run overtook) answers, for up to 10 minutes. The count's runs are deleted after it, so that the
next count finds the engine's adapter slots as the earlier scenarios left them. One version of the
bench run is published first, so that one-off costs (the engine wraps the base model on its first
adapter) do not fall on the one-run count.

Per count (all from the runs' own responses and the event stream):

    rollout tokens/s   completion tokens of every run's rollouts / the count's wall time (the
                       first run's start to the last run's last version serving)
    train tokens/s     tokens trained / the trainer's time in the steps (`train_s` of each
                       version: activating the run's adapter and optimizer state, forward,
                       backward, optimizer step; the pipeline scenario's measure); switching runs
                       costs here, in `activate_s`
    steps/min per run  a run's steps / its own wall time (its start to its last version serving)
    step -> served     optimizer step done -> the first response by the new version (probe), p50/p95
    step -> loaded     optimizer step done -> `adapter_loaded` (the run routed to it), p50/p95
    fairness           min / max of the runs' steps/min (each run's share of the throughput,
                       smallest over largest; 1.0 is even)

and against one run: aggregate rollout tokens/s and train tokens/s at N / at 1, and step -> served
p95 at N / at 1. Targets (GPU, 0.5B shape, 32 runs against 1): rollout ≥ 0.85, train ≥ 0.80,
step -> served p95 ≤ 2 x, fairness ≥ 0.8. They are goals on GPUs; on the CPU the table shows them
beside the ratios (the CPU engine batches only identical requests and shares two cores with the
trainer, so more runs mostly queue there). What is measured is what the stack does: the trainer's
fair turns across runs (docs/operations.md) and the engine's adapter slots (the suite's 128, or
`--engine-slots 8`, the shipped default, under which 32 runs of 8 steps cycle 256 versions through 8).

    full: 1, 8 and 32 runs, 8 steps each on GPUs, 4 on the CPU; quick: 1 and 4 runs, 2 steps each
    (--density-runs 1,4,8 on the suite sets the counts)
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.benchlib import Ctx, bench_run, goal, md_table, new_version, plt, save_figure, summary
from bench.scenarios.sync import Prober
from tandem import LoraConfig, OptimizerConfig
from tandem.client import Run
from tandem.dev import toy
from tandem.errors import RunBusy
from tandem.events import EventKind

#: GPU targets at the largest count against one run: rollout and train tokens/s at least these shares of one
#: run's, step -> served p95 at most this multiple of one run's, fairness (min / max steps/min) at least this.
TARGETS = {"rollout": 0.85, "train": 0.80, "served_p95": 2.0, "fairness": 0.8}
PROMPTS_PER_STEP = 4
GROUP_SIZE = 8
#: How long a prober waits for a version to serve: 32 runs on 2 CPU cores took 90 s from step to loaded.
PROBE_HORIZON_S = 600.0


@dataclass
class Lane:
    """One run's client: what it did, and when its last version served."""

    run: Run
    steps_done: int = 0
    tokens: int = 0
    """Completion tokens of its rollouts."""
    ended_at: float = 0.0
    error: str = ""


def plan(ctx: Ctx) -> tuple[list[int], int]:
    """(run counts, steps per run): 4 steps a run on the CPU, where 32 runs of 8 took 7 minutes."""
    counts = list(ctx.density_runs) if ctx.density_runs else ([1, 4] if ctx.quick else [1, 8, 32])
    return counts, 2 if ctx.quick else 8 if ctx.device.startswith("cuda") else 4


def drive(lane: Lane, steps: int, max_tokens: int, digits: frozenset[int], start: threading.Barrier) -> None:
    """A run's loop: roll out a step while the previous one trains, then wait for its last version."""
    run = lane.run
    try:
        start.wait()
        for step in range(1, steps + 1):
            rolled = toy.roll_out(run, digits, toy.prompts_for(step, PROMPTS_PER_STEP), group_size=GROUP_SIZE,
                                  max_tokens=max_tokens)
            lane.tokens += sum(len(t.completion_ids) for g in rolled.groups for t in g.trajectories)
            run.train(rolled.groups, wait=False)  # returns once at most one step is still unserved
            lane.steps_done = step
        run.wait_all()
    except Exception as exc:  # noqa: BLE001 - the count goes on: the report says what failed
        lane.error = f"{type(exc).__name__}: {exc}"[:300]
    lane.ended_at = time.time()


def one_count(ctx: Ctx, count: int, steps: int, digits: frozenset[int]) -> dict[str, Any]:
    """`count` runs at once, `steps` each: what they did, measured."""
    assert ctx.stack is not None and ctx.client is not None
    rank = 8 if ctx.engine == "transformers" else 16
    max_tokens = 16 if ctx.engine == "transformers" else 128
    lanes = [Lane(ctx.client.create_run(f"dens-{count:02d}-{i:02d}-{ctx.call}", base_model=ctx.model,
                                        lora=LoraConfig(r=rank, alpha=2 * rank),
                                        optimizer=OptimizerConfig(lr=ctx.lr), max_staleness_steps=1))
             for i in range(1, count + 1)]
    start = threading.Barrier(count + 1)
    threads = [threading.Thread(target=drive, args=(lane, steps, max_tokens, digits, start), daemon=True)
               for lane in lanes]
    with ExitStack() as probing:
        probers = {lane.run.name: probing.enter_context(Prober(ctx.stack.gateway_url, ctx.client, lane.run.name,
                                                               horizon_s=PROBE_HORIZON_S))
                   for lane in lanes}
        for t in threads:
            t.start()
        start.wait()
        t0 = time.time()
        for t in threads:
            t.join()
        settle(lanes, probers)
        for prober in probers.values():  # all at once: each then ends within its read's 200 ms
            prober.stop.set()
    row = measure(ctx, lanes, probers, t0, steps)
    row["max_tokens"] = max_tokens
    row["deleted"] = delete_runs(ctx, [lane.run.name for lane in lanes])
    return row


def settle(lanes: list[Lane], probers: dict[str, Prober], timeout_s: float = 120.0) -> None:
    """Wait until each run's last version has answered its prober: the run saw it loaded, but the prober
    takes one version at a time and may still be on the one before (bounded by `timeout_s`)."""
    deadline = time.time() + timeout_s
    for lane in (lane for lane in lanes if not lane.error):  # a failed run's last version may never serve
        while served_at(probers[lane.run.name], lane.steps_done) is None and time.time() < deadline:
            time.sleep(0.05)


def measure(ctx: Ctx, lanes: list[Lane], probers: dict[str, Prober], t0: float, steps: int) -> dict[str, Any]:
    """One count's row from its lanes, its probers and the event stream since `t0`."""
    assert ctx.client is not None
    names = {lane.run.name for lane in lanes}
    events = [e for e in ctx.client.events.since(t0 - 1) if e.run in names]
    ready = {(e.run, e.version): e for e in events if e.kind is EventKind.ADAPTER_READY}
    loaded: dict[tuple[str, int | None], float] = {}
    for e in events:
        if e.kind is EventKind.ADAPTER_LOADED:
            loaded.setdefault((e.run, e.version), e.ts)
    served, to_loaded = [], []
    for (run, version), e in ready.items():
        stepped = e.data.get("stepped_at")
        if not stepped or version is None:
            continue
        if (run, version) in loaded:
            to_loaded.append((loaded[(run, version)] - stepped) * 1000)
        if (end := served_at(probers[run], version)) is not None:
            served.append((end - stepped) * 1000)
    metrics = [e.data.get("metrics") or {} for e in ready.values()]
    trained = sum(m.get("tokens", 0.0) for m in metrics)
    train_s = sum(m.get("train_s", 0.0) for m in metrics)
    wall = max(lane.ended_at for lane in lanes) - t0
    per_run = [{"run": lane.run.name, "steps": lane.steps_done, "tokens": lane.tokens,
                "steps_per_min": lane.steps_done / (lane.ended_at - t0) * 60, "error": lane.error} for lane in lanes]
    rates = [r["steps_per_min"] for r in per_run]
    s, ld = summary(served), summary(to_loaded)
    return {
        "runs": len(lanes), "steps": steps, "wall_s": wall, "versions": len(ready),
        "rollout_tokens_per_s": sum(lane.tokens for lane in lanes) / wall,
        "train_tokens_per_s": trained / train_s if train_s else float("nan"),
        "trained_tokens_per_wall_s": trained / wall, "trainer_busy": train_s / wall,
        "activate_ms_p50": summary([m["activate_s"] * 1000 for m in metrics if "activate_s" in m])["p50"],
        "steps_per_min_min": min(rates), "steps_per_min_median": statistics.median(rates),
        "steps_per_min_max": max(rates), "fairness": min(rates) / max(rates) if max(rates) else 0.0,
        "served_ms_p50": s["p50"], "served_ms_p95": s["p95"], "served_n": s["n"],
        "loaded_ms_p50": ld["p50"], "loaded_ms_p95": ld["p95"],
        "failed_runs": sum(bool(lane.error) for lane in lanes),
        "probe_errors": sum(p.errors for p in probers.values()),
        "unserved": len(ready) - s["n"],
        "errors": sorted({lane.error for lane in lanes if lane.error})[:3],
        "per_run": per_run,
    }


def served_at(prober: Prober, version: int) -> float | None:
    """When the first probe response by `version` or a newer one came back: a probe for an older version may
    have been the first answered by it (the prober takes one version at a time)."""
    ends = [prober.first[v][0] for v, by in prober.answered.items() if by >= version]
    return min(ends) if ends else None


def delete_runs(ctx: Ctx, names: Sequence[str], timeout_s: float = 60.0) -> int:
    """Delete the count's runs (their adapters leave the engine); a run whose last job is still saving
    its state is busy for a moment: try again until `timeout_s`. Returns how many were deleted."""
    assert ctx.client is not None
    deleted = 0
    deadline = time.time() + timeout_s
    for name in names:
        while True:
            try:
                ctx.client.delete_run(name)
                deleted += 1
                break
            except RunBusy:
                if time.time() > deadline:
                    ctx.progress(f"{name} still busy after {timeout_s:.0f} s: left in place")
                    break
                time.sleep(0.2)
    return deleted


def ratios(rows: list[dict[str, Any]]) -> None:
    """Each row against the one-run row, in place (None where there is no one-run row)."""
    one = next((r for r in rows if r["runs"] == 1), None)
    for r in rows:
        r["rollout_ratio"] = r["rollout_tokens_per_s"] / one["rollout_tokens_per_s"] if one else None
        r["train_ratio"] = r["train_tokens_per_s"] / one["train_tokens_per_s"] if one else None
        r["served_p95_ratio"] = r["served_ms_p95"] / one["served_ms_p95"] if one and one["served_ms_p95"] else None


def goals_of(ctx: Ctx, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Nothing failed, every version served (everywhere); the density targets at the largest count (GPUs)."""
    failed = sum(r["failed_runs"] + r["probe_errors"] + r["unserved"] for r in rows)
    goals = [goal("failed runs, failed probes and versions never seen served", float(failed), 0.0)]
    top = rows[-1]
    if not ctx.device.startswith("cuda") or top["runs"] == 1 or top["rollout_ratio"] is None:
        return goals
    n = top["runs"]
    return goals + [
        goal(f"{n} runs: aggregate rollout tokens/s / one run's", top["rollout_ratio"], TARGETS["rollout"],
             at_most=False),
        goal(f"{n} runs: train tokens/s / one run's", top["train_ratio"], TARGETS["train"], at_most=False),
        goal(f"{n} runs: step -> served p95 / one run's", top["served_p95_ratio"] or float("inf"),
             TARGETS["served_p95"]),
        goal(f"{n} runs: per-run throughput, min / max (fairness)", top["fairness"], TARGETS["fairness"],
             at_most=False),
    ]


def table_of(rows: list[dict[str, Any]]) -> str:
    def ratio(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}"

    return md_table(
        ["runs", "steps each", "wall s", "rollout tokens/s", f"÷ 1 run (≥ {TARGETS['rollout']})", "train tokens/s",
         f"÷ 1 run (≥ {TARGETS['train']})", "trainer busy", "activate ms p50", "steps/min per run min / median / max",
         f"fairness min/max (≥ {TARGETS['fairness']})", "step → served p50 / p95 ms",
         f"p95 ÷ 1 run (≤ {TARGETS['served_p95']:g})", "step → loaded p50 / p95 ms", "failed"],
        [[r["runs"], r["steps"], r["wall_s"], r["rollout_tokens_per_s"], ratio(r["rollout_ratio"]),
          r["train_tokens_per_s"], ratio(r["train_ratio"]), f"{r['trainer_busy']:.0%}", r["activate_ms_p50"],
          f"{r['steps_per_min_min']:.1f} / {r['steps_per_min_median']:.1f} / {r['steps_per_min_max']:.1f}",
          f"{r['fairness']:.2f}", f"{r['served_ms_p50']:.0f} / {r['served_ms_p95']:.0f}", ratio(r["served_p95_ratio"]),
          f"{r['loaded_ms_p50']:.0f} / {r['loaded_ms_p95']:.0f}",
          r["failed_runs"] + r["probe_errors"] + r["unserved"]] for r in rows])


def run(ctx: Ctx) -> dict[str, Any]:
    counts, steps = plan(ctx)
    digits = toy.digit_token_ids(ctx.model)
    # one-off costs (the engine wraps the base model on its first adapter) stay out of the one-run count
    ctx.progress(f"warm-up: v{new_version(bench_run(ctx))} of {ctx.run_name} serving")
    rows = []
    for count in counts:
        ctx.progress(f"{count} run(s), {steps} steps each ...")
        row = one_count(ctx, count, steps, digits)
        rows.append(row)
        ctx.progress(f"{count} run(s): {row['rollout_tokens_per_s']:.0f} rollout tokens/s, "
                     f"{row['train_tokens_per_s']:.0f} train tokens/s, fairness {row['fairness']:.2f}, "
                     f"step -> served p95 {row['served_ms_p95']:.0f} ms, {row['failed_runs']} failed")
    ratios(rows)
    table = table_of(rows)
    table += (f"\n\nEach run: the toy task, {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} completions a step, "
              f"max_tokens {rows[0]['max_tokens']}, max_staleness_steps 1, its own client thread; ratios are "
              "against one run; the targets in the header are the GPU's (0.5B shape, the largest count against one).")
    if ctx.engine == "transformers":
        table += (" On the CPU the engine runs one batch at a time and batches only identical requests, and the "
                  "trainer shares the same two cores: the ratios there say how the stack queues, not what a GPU does.")
    errors = sorted({e for r in rows for e in r["errors"]})[:3]
    if errors:
        table += "\n\nErrors seen: " + "; ".join(errors)
    plot_name = "density.png"
    plot(rows, ctx.out / plot_name)
    return {"name": "density", "title": "12. Many runs on one base (density)",
            "summary": {"counts": counts, "steps": steps, "targets": TARGETS,
                        "by_runs": {r["runs"]: {k: v for k, v in r.items() if k != "per_run"} for r in rows}},
            "rows": rows, "goals": goals_of(ctx, rows), "table": table, "plots": [plot_name]}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    pyplot = plt()
    fig, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4))
    xs = range(len(rows))
    labels = [str(r["runs"]) for r in rows]
    left.bar([x - 0.2 for x in xs], [r["rollout_tokens_per_s"] for r in rows], 0.4, label="rollout tokens/s")
    left.bar([x + 0.2 for x in xs], [r["train_tokens_per_s"] for r in rows], 0.4, label="train tokens/s")
    left.set_xticks(list(xs), labels)
    left.set_xlabel("runs on one base")
    left.set_ylabel("tokens per second")
    left.set_title("Aggregate throughput")
    left.legend(fontsize=8)
    for x, r in zip(xs, rows, strict=True):  # each run's steps/min against the count's fastest run
        rates = [p["steps_per_min"] for p in r["per_run"]]
        spread = [x + (i / (len(rates) - 1) - 0.5) * 0.5 if len(rates) > 1 else x for i in range(len(rates))]
        right.scatter(spread, [v / max(rates) if max(rates) else 0.0 for v in rates], s=12)
    right.axhline(TARGETS["fairness"], color="grey", linestyle="--", linewidth=1, label="GPU target (min / max)")
    right.set_xticks(list(xs), labels)
    right.set_ylim(0, 1.05)
    right.set_xlabel("runs on one base")
    right.set_ylabel("steps/min of each run / the fastest run's")
    right.set_title("Per-run throughput share (fairness)")
    right.legend(fontsize=8, loc="lower left")
    save_figure(fig, path)


def replot(result: dict[str, Any], out: Path) -> None:
    plot(result["rows"], out / "density.png")
