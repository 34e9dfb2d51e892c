"""The toy task that proves the loop: teach a model to answer with digits.

reward = share of completion tokens that are digit tokens. The script starts the whole stack
as local processes (Redis, engine, inference, trainer), creates a run, and for each step
rolls out groups through the gateway, scores them, trains one GRPO step and waits until the
new version serves (or pipelines with --max-staleness > 0). It prints a row per step, a
summary table, writes a reward curve PNG and the rows as JSON, and exits non-zero when the
reward did not rise.

    python examples/digits.py --steps 40            # what `make demo` runs

With --gateway (and --redis, or TANDEM_REDIS__URL) it starts nothing and trains against a
stack that is already running, e.g. the containers (`docker compose -f compose.yaml -f compose.client.yaml up -d`
publishes the gateway and Redis on loopback). --model is then the base model as the stack's
services name it (TANDEM_MODEL); digit tokens come from its tokenizer.json (--tokenizer, or
the hub when --model is a hub id):

    export TANDEM_REDIS__URL="redis://tandem-client:$REDIS_CLIENT_PASSWORD@127.0.0.1:6379/0"  # or --redis
    python examples/digits.py --gateway http://127.0.0.1:8000 --model Qwen/Qwen2.5-1.5B-Instruct
    # the CPU containers: their tiny model is byte-identical to the one built here
    python examples/digits.py --gateway ... --redis ... --model /models/tiny --tokenizer .tandem/models/tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from tandem import Client, LoraConfig, OptimizerConfig
from tandem.dev import toy
from tandem.dev.demo import add_stack_arguments, base_model, open_client, parse_stack_arguments, tokenizer_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--max-staleness", type=int, default=0, help="0 = synchronous; 1-2 = pipelined")
    add_stack_arguments(parser, out=".tandem/demo", run="digits", min_rise=0.3)
    args = parse_stack_arguments(parser)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    out = Path(args.out)
    digits = toy.digit_token_ids(tokenizer_dir(args.model, args.tokenizer))
    with ExitStack() as stack:
        client = open_client(stack, args)
        rows = train(client, digits, args)
    return report(rows, out, args.min_rise)


def train(client: Client, digits: frozenset[int], args: argparse.Namespace) -> list[dict]:
    """Create (or open) the run and train it for --steps steps; one row per step."""
    run = client.create_run(
        args.run,
        base_model=base_model(args),
        lora=LoraConfig(r=8, alpha=16),
        optimizer=OptimizerConfig(lr=args.lr),
        max_staleness_steps=max(args.max_staleness, 0),
    )
    print(f"{'step':>4} {'reward':>7} {'served by':>9} {'new ver':>7} {'rollout s':>9} {'train s':>7} "
          f"{'sync s':>7} {'publish→loaded ms':>17}")
    rows = []
    t_start = time.monotonic()
    for step in range(1, args.steps + 1):
        t0 = time.monotonic()
        step_rollouts = toy.roll_out(run, digits, toy.prompts_for(step, args.prompts_per_step),
                                     group_size=args.group_size, max_tokens=args.max_tokens)
        t1 = time.monotonic()
        result = run.train(step_rollouts.groups, wait=args.max_staleness == 0)
        t2 = time.monotonic()
        versions = step_rollouts.versions
        row = {"step": step, "reward": step_rollouts.mean_reward, "served_by": max(versions),
               "oldest_served_by": min(versions), "rollout_s": t1 - t0, "sync_s": t2 - t1,
               "wall_s": t2 - t_start}
        if hasattr(result, "version"):
            served_at = result.metrics.get("served_at", 0.0)
            row |= {"version": result.version, "train_s": result.train_s,
                    "publish_to_loaded_ms": (served_at - result.published_at) * 1000 if served_at else None}
        rows.append(row)
        print(f"{step:>4} {row['reward']:>7.3f} {'v' + str(row['served_by']):>9} "
              f"{'v' + str(row.get('version', '?')):>7} {row['rollout_s']:>9.2f} {row.get('train_s', 0):>7.2f} "
              f"{row['sync_s']:>7.2f} {row.get('publish_to_loaded_ms') or 0:>17.1f}", flush=True)
    run.wait_all()
    return rows


def report(rows: list[dict], out: Path, min_rise: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    first = statistics.fmean(r["reward"] for r in rows[:5])
    last = statistics.fmean(r["reward"] for r in rows[-5:])
    plot(rows, out / "reward.png")
    print()
    print(f"reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f} (rise {last - first:+.3f})")
    sync = sorted(r["sync_s"] for r in rows)
    print(f"sync latency (train() to new version serving): median {statistics.median(sync):.2f} s, max {sync[-1]:.2f} s")
    print(f"reward curve: {out / 'reward.png'}   rows: {out / 'rows.json'}")
    if last - first < min_rise:
        print(f"FAILED: the reward rose by {last - first:.3f}, less than {min_rise}", file=sys.stderr)
        return 1
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["reward"] for r in rows], marker="o", ms=3)
    ax.set_xlabel("train step")
    ax.set_ylabel("mean reward (share of digit tokens)")
    ax.set_ylim(0, 1.02)
    ax.set_title("tandem toy task: reward per step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
