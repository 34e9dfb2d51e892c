"""Scenario 5, sync vs async RL: the toy task (reward = share of digit tokens) run
synchronously (roll out, train, wait until the new version serves) and pipelined with
`max_staleness_steps` 1 and 2 (rollouts of step k+1 go on while step k trains).

Reports wall time per step, the reward after K steps, and how busy each side was: the
rollout side's share of wall time spent in rollouts, the trainer's share spent in its jobs
(training, writing and announcing the version, saving its state: rq's start and end times). The
goal: a pipelined step takes at most 1.15 x max(rollout time, train time).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from rq.job import Job
from rq.serializers import JSONSerializer

from bench.benchlib import Ctx, goal, md_table, plt, save_figure
from tandem import LoraConfig, OptimizerConfig
from tandem.dev import toy

MODES = {"sync": 0, "async-1": 1, "async-2": 2}


def one_mode(ctx: Ctx, mode: str, staleness: int, steps: int, digits: frozenset[int]) -> dict[str, Any]:
    assert ctx.client is not None
    rank = 8 if ctx.engine == "transformers" else 16
    run = ctx.client.create_run(f"pipe-{mode}-{ctx.call}", base_model=ctx.model, lora=LoraConfig(r=rank, alpha=2 * rank),
                                optimizer=OptimizerConfig(lr=ctx.lr), max_staleness_steps=staleness)
    rows: list[dict[str, Any]] = []
    job_ids: list[str] = []
    t_start = time.time()
    for step in range(1, steps + 1):
        t0 = time.time()
        rolled = toy.roll_out(run, digits, toy.prompts_for(step, 4), group_size=8, max_tokens=16)
        t1 = time.time()
        out = run.train(rolled.groups, wait=staleness == 0)
        job_ids.append(out.job_id)
        rows.append({"step": step, "reward": rolled.mean_reward, "served_by": max(rolled.versions),
                     "rollout_s": t1 - t0, "submit_wait_s": time.time() - t1, "t": time.time() - t_start})
        ctx.progress(f"{mode}: step {step}/{steps} reward {rolled.mean_reward:.2f} served by v{max(rolled.versions)}")
    run.wait_all()
    wall = time.time() - t_start  # until the last version serves
    # the trainer is busy for the whole job: training, writing and announcing the version, its state
    # (written after the announcement, so the last job may still be running: wait for it)
    jobs = _ended_jobs(ctx, job_ids)
    if not jobs:
        raise RuntimeError(f"{mode}: none of the {len(job_ids)} trainer jobs has ended in rq; see the trainer's log")
    train_s = [(j.ended_at - j.started_at).total_seconds() for j in jobs]
    # the tokens each job trained on (every rank's share together), over the time the trainer spent in
    # its forward and backward passes and optimizer step
    results = [j.return_value() or {} for j in jobs]
    tokens = sum(r.get("metrics", {}).get("tokens", 0.0) for r in results)
    step_train_s = sum(r.get("metrics", {}).get("train_s", 0.0) for r in results)
    rollout_s = [r["rollout_s"] for r in rows]
    step_s = wall / steps
    bound = max(statistics.fmean(rollout_s), statistics.fmean(train_s))
    tail = rows[-3:]
    return {
        "mode": mode, "max_staleness": staleness, "steps": steps, "wall_s": wall, "step_s": step_s,
        "rollout_s_mean": statistics.fmean(rollout_s), "train_s_mean": statistics.fmean(train_s),
        "train_tokens_per_s": tokens / step_train_s if step_train_s else None,
        "step_over_bound": step_s / bound,
        "reward_first3": statistics.fmean(r["reward"] for r in rows[:3]),
        "reward_last3": statistics.fmean(r["reward"] for r in tail),
        "rollout_busy": sum(rollout_s) / wall, "trainer_busy": sum(train_s) / wall,
        "max_lag": max(r["step"] - 1 - r["served_by"] for r in rows),
        "rows": rows,
    }


def _ended_jobs(ctx: Ctx, job_ids: list[str], timeout_s: float = 120.0) -> list[Job]:
    assert ctx.client is not None
    deadline = time.time() + timeout_s
    while True:
        jobs = Job.fetch_many(job_ids, connection=ctx.client.conn, serializer=JSONSerializer)
        ended = [j for j in jobs if j and j.started_at and j.ended_at]
        if len(ended) == len(job_ids) or time.time() > deadline:
            return ended
        time.sleep(0.05)


def run(ctx: Ctx) -> dict[str, Any]:
    steps = 6 if ctx.quick else 20
    digits = toy.digit_token_ids(ctx.model)
    modes = [one_mode(ctx, mode, s, steps, digits) for mode, s in MODES.items()]
    goals = [goal(f"{m['mode']}: step time / max(rollout, trainer job)", m["step_over_bound"], 1.15,
                  note=f"step {m['step_s']:.2f} s, rollout {m['rollout_s_mean']:.2f} s, trainer job {m['train_s_mean']:.2f} s")
             for m in modes if m["max_staleness"] > 0]
    table = md_table(
        ["mode", "steps", "wall s", "s / step", "rollout s", "trainer job s", "step / max(rollout, job)",
         "reward first 3 → last 3", "rollout busy", "trainer busy", "max staleness seen", "train tokens/s"],
        [[m["mode"], m["steps"], m["wall_s"], m["step_s"], m["rollout_s_mean"], m["train_s_mean"],
          m["step_over_bound"], f"{m['reward_first3']:.2f} → {m['reward_last3']:.2f}",
          f"{m['rollout_busy']:.0%}", f"{m['trainer_busy']:.0%}", m["max_lag"], m["train_tokens_per_s"]]
         for m in modes])
    if ctx.engine == "transformers":
        table += ("\n\nOn the CPU profile the engine and the trainer share the same cores, so the two sides "
                  "of a pipelined step also compete for CPU; on GPUs each side has its own device.")
    plot_name = "sync_vs_async.png"
    rows = [{"mode": m["mode"], **r} for m in modes for r in m["rows"]]
    plot(rows, ctx.out / plot_name)
    summary = {m["mode"]: {k: v for k, v in m.items() if k != "rows"} for m in modes}
    return {"name": "pipeline", "title": "5. Sync vs async RL", "summary": summary,
            "rows": rows, "goals": goals,
            "table": table, "plots": [plot_name]}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(8, 3.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["t"] for r in mine], [r["reward"] for r in mine], marker=".", label=mode)
    ax.set_xlabel("wall time, s")
    ax.set_ylabel("reward (digit share)")
    ax.set_title("Reward vs wall time: synchronous and pipelined")
    ax.legend()
    save_figure(fig, path)


def replot(result: dict[str, Any], out: Path) -> None:
    plot(result["rows"], out / "sync_vs_async.png")
