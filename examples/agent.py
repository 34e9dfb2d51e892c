"""A multi-turn agent with a tool, trained on whole episodes: find the coin in the drawers.

Ten drawers, 0 to 9; the coin is in drawer 7 (the agent is not told). Each episode has two
assistant turns:

  1. the agent opens a drawer: the first digit it writes is the call of the `open_drawer` tool
     (a tool call the tiny random model can learn within minutes; a model that writes OpenAI
     tool calls is read the same way, from the call's `drawer` argument);
  2. the environment answers with the tool's result (`drawer 3: empty`, `drawer 7: the coin`)
     and asks where the coin is; the agent answers with a digit.

reward = the mean of the two turns' scores: 1 for the coin's drawer (opened in turn 1, named
in turn 2), less for a drawer further from it (0.75 for a neighbour, 0 from four away on), 0
for no digit at all. The partial credit gives a random policy a gradient from the first step;
it also lets a policy settle on a neighbour of the coin's drawer (reward 0.75), as some runs do. Every turn goes through the
episode API (`run.episode`): the gateway keeps the episode's token ids and samples each turn
from them plus the template's ids of the tool result and the question, so the trajectory
holds exactly the ids the model sampled (loss mask 1) and the messages between (mask 0). Sixteen
episodes of one start make a GRPO group.

    python examples/agent.py                       # what `make agent` runs: the local stack, 60 steps

With --gateway (and --redis, or TANDEM_REDIS__URL) it starts nothing and trains against a
running stack, e.g. the CPU containers (`docker compose -f compose.yaml -f compose.client.yaml up -d`):

    export TANDEM_REDIS__URL="redis://tandem-client:$REDIS_CLIENT_PASSWORD@127.0.0.1:6379/0"  # or --redis
    python examples/agent.py --gateway http://127.0.0.1:8000 --model /models/tiny --tokenizer .tandem/models/tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from tandem import Client, Episode, LoraConfig, OptimizerConfig, Run, TrajectoryGroup
from tandem.dev.demo import add_stack_arguments, base_model, open_client, parse_stack_arguments, tokenizer_dir

COIN = 7
OPEN_DRAWER = {"type": "function", "function": {
    "name": "open_drawer", "description": "Open a drawer.",
    "parameters": {"type": "object", "properties": {"drawer": {"type": "integer"}}}}}
STARTS = (
    "Find the coin. Open a drawer: say its digit.",
    "Which drawer? Say one digit.",
    "Open one drawer, 0 to 9.",
    "Look for the coin in a drawer.",
)
QUESTION = "Which drawer holds the coin? Say its digit."
DIGIT = re.compile(r"\d")


def opened(turn_text: str, tool_calls: list[dict]) -> int | None:
    """The drawer a turn opened: an `open_drawer` call's argument, else the first digit written."""
    for call in tool_calls:
        try:
            return int(json.loads(call["function"]["arguments"])["drawer"]) % 10
        except (KeyError, TypeError, ValueError):
            continue
    found = DIGIT.search(turn_text)
    return int(found.group()) if found else None


def score(drawer: int | None) -> float:
    """One turn's score: 1 for the coin's drawer, less the further the drawer is from it, 0 for no digit."""
    return 0.0 if drawer is None else max(0.0, 1.0 - abs(drawer - COIN) / 4)


@dataclass
class Outcome:
    """One episode, played to its end and scored."""

    episode: Episode
    reward: float
    found: bool
    trainable: bool


def play(run: Run, start: str, args: argparse.Namespace, turn_start: int | None) -> Outcome:
    """One episode: open a drawer, read the tool's result, answer."""
    ep = run.episode([{"role": "user", "content": start}], tools=[OPEN_DRAWER] if args.tools else None)
    first = ep.sample(max_tokens=args.max_tokens, temperature=1.0)
    drawer = opened(first.text, first.tool_calls)
    result = "nothing opened" if drawer is None else f"drawer {drawer}: {'the coin' if drawer == COIN else 'empty'}"
    call_id = first.tool_calls[0]["id"] if first.tool_calls else None
    ep.add({"role": "tool", "content": result, **({"tool_call_id": call_id} if call_id else {})},
           {"role": "user", "content": QUESTION})
    second = ep.sample(max_tokens=args.max_tokens, temperature=1.0)
    answer = opened(second.text, second.tool_calls)
    # A random model may sample the template's turn-start token inside a turn; the trainer refuses
    # a trained span that holds one (it reads as a message the model did not write), so such an
    # episode is scored but not trained on.
    sampled = [t for turn in ep.turns for t in turn.completion_ids]
    return Outcome(ep, (score(drawer) + score(answer)) / 2, drawer == COIN, turn_start not in sampled)


def step_groups(run: Run, step: int, args: argparse.Namespace, turn_start: int | None,
                pool: ThreadPoolExecutor) -> tuple[list[TrajectoryGroup], list[Outcome]]:
    """A group of episodes per start, played at once, scored, closed."""
    starts = [STARTS[(step * args.starts_per_step + s) % len(STARTS)] for s in range(args.starts_per_step)]
    futures = [[pool.submit(play, run, start, args, turn_start) for _ in range(args.group_size)] for start in starts]
    groups, outcomes = [], []
    for group in futures:
        played = [f.result() for f in group]
        outcomes += played
        kept = [o for o in played if o.trainable]
        if len(kept) >= 2:
            groups.append(run.group([o.episode for o in kept], [o.reward for o in kept]))
        for o in played:
            o.episode.close()
    return groups, outcomes


def turn_start_id(tokenizer: Path) -> int | None:
    """The id of ChatML's `<|im_start|>` in the model's tokenizer.json, if it has one."""
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    return next((t["id"] for t in data.get("added_tokens", []) if t["content"] == "<|im_start|>"), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--starts-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4, help="per assistant turn")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tools", action=argparse.BooleanOptionalAction, default=True,
                        help="pass the open_drawer tool to the chat template (--no-tools: a shorter prompt)")
    add_stack_arguments(parser, out=".tandem/agent", run="agent", min_rise=0.2)
    args = parse_stack_arguments(parser)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    out = Path(args.out)
    turn_start = turn_start_id(tokenizer_dir(args.model, args.tokenizer))
    with ExitStack() as stack:
        client = open_client(stack, args)
        rows = train(client, args, turn_start)
    return report(rows, out, args.min_rise)


def train(client: Client, args: argparse.Namespace, turn_start: int | None) -> list[dict]:
    """Create (or open) the run and train it for --steps steps; one row per step."""
    run = client.create_run(args.run, base_model=base_model(args),
                            lora=LoraConfig(r=8, alpha=16), optimizer=OptimizerConfig(lr=args.lr))
    print(f"{'step':>4} {'reward':>7} {'coin found':>10} {'episodes':>8} {'served by':>9} {'new ver':>7} "
          f"{'rollout s':>9} {'train s':>7}")
    rows = []
    t_start = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.group_size * args.starts_per_step) as pool:
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            groups, outcomes = step_groups(run, step, args, turn_start, pool)
            t1 = time.monotonic()
            result = run.train(groups) if groups else None
            t2 = time.monotonic()
            versions = [min(o.episode.state.versions) for o in outcomes if o.episode.state]
            row = {"step": step, "reward": statistics.fmean(o.reward for o in outcomes),
                   "coin_found": statistics.fmean(o.found for o in outcomes),
                   "trained_episodes": sum(len(g.trajectories) for g in groups), "episodes": len(outcomes),
                   "served_by": min(versions), "rollout_s": t1 - t0, "sync_s": t2 - t1, "wall_s": t2 - t_start,
                   "version": getattr(result, "version", None), "train_s": getattr(result, "train_s", 0.0)}
            rows.append(row)
            print(f"{step:>4} {row['reward']:>7.3f} {row['coin_found']:>10.2f} "
                  f"{row['trained_episodes']:>3}/{row['episodes']:<4} {'v' + str(row['served_by']):>9} "
                  f"{'v' + str(row['version']):>7} {row['rollout_s']:>9.2f} {row['train_s']:>7.2f}", flush=True)
    return rows


def report(rows: list[dict], out: Path, min_rise: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    first = statistics.fmean(r["reward"] for r in rows[:5])
    last = statistics.fmean(r["reward"] for r in rows[-5:])
    found_first = statistics.fmean(r["coin_found"] for r in rows[:5])
    found_last = statistics.fmean(r["coin_found"] for r in rows[-5:])
    plot(rows, out / "reward.png")
    print()
    print(f"reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f} (rise {last - first:+.3f}); "
          f"coin found {found_first:.2f} -> {found_last:.2f}; {rows[-1]['wall_s']:.0f} s")
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
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["reward"] for r in rows], marker="o", ms=3, label="mean reward")
    ax.plot(steps, [r["coin_found"] for r in rows], marker=".", ms=3, alpha=0.7, label="share that opened the coin's drawer")
    ax.set_xlabel("train step")
    ax.set_ylabel("per episode")
    ax.set_ylim(0, 1.02)
    ax.set_title("tandem agent example: two turns and a tool, reward per step")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
