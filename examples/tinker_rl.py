"""tinker-cookbook's own RL loop, unmodified, trained against tandem's Tinker API.

The task is tandem's toy one (`make demo`): reward = share of the completion's tokens that are
digits. It needs no judge and no data, and the tiny model learns it in a few dozen steps. This
file brings only what the cookbook asks of a task (an `RLDatasetBuilder` of `EnvGroupBuilder`s of
single-turn `Env`s); the loop itself is `tinker_cookbook.rl.train.main`, with `loss_fn`
`importance_sampling` or `ppo`.

The model is named as the stack names it: by default the tiny model's directory, which `tandem up`
serves under its absolute path. The cookbook's `get_tokenizer` reads a local directory itself
(offline), and the renderer is picked here (`qwen3_instruct`: ChatML without thinking tags, the
tiny model's own chat template) instead of `model_info.get_recommended_renderer_name`, which only
knows hub names. A stack that names its model otherwise (the containers' `/models/tiny`, a hub id
without the hub) takes `--tokenizer DIR`, registered for that name with `register_tokenizer`.

    tandem up &                                      # the stack, with its Tinker API
    set -a; . .tandem/stack/client.env; set +a    # TINKER_BASE_URL, as `tandem up` wrote it
    export TINKER_API_KEY=tml-$TANDEM_GATEWAY__API_KEY  # the gateway's key; any tml-... on a keyless local stack
    make cookbook && .venv-cookbook/bin/python examples/tinker_rl.py --loss-fn ppo --steps 40

It prints a line per step (mean reward), writes the cookbook's logs under --log-path, and exits
non-zero when the reward (mean of the last 5 steps minus the first 5) rose by less than --min-rise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.completers import StopCondition
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import (
    Action,
    ActionExtra,
    Env,
    EnvGroupBuilder,
    Metrics,
    Observation,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
    Trajectory,
)
from tinker_cookbook.tokenizer_utils import Tokenizer, get_tokenizer, register_tokenizer

PROMPTS = (  # tandem.dev.toy.PROMPTS: the same task as `make demo`
    "Write some numbers.",
    "What comes next: 3 5 7",
    "Tell me about your day.",
    "Give me a phone number.",
    "Count for me.",
    "What is the answer?",
    "Say something.",
    "List a few values.",
)
RENDERER = "qwen3_instruct"
REWARD_KEY = "env/all/reward/total"  # what rl.train logs as the batch's mean reward
TINY_MODEL = ".tandem/models/tiny"


def digit_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the vocabulary entries made of ASCII digits only (Qwen2-style tokenizers split digits)."""
    return frozenset(i for token, i in tokenizer.get_vocab().items() if token.isascii() and token.isdigit())


class DigitsEnv(Env):
    """One prompt, one completion; reward = share of the completion's tokens that are digits."""

    def __init__(self, prompt: str, renderer: renderers.Renderer, digits: frozenset[int]) -> None:
        self.prompt = prompt
        self.renderer = renderer
        self.digits = digits

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        convo: list[renderers.Message] = [{"role": "user", "content": self.prompt}]
        return self.renderer.build_generation_prompt(convo), self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        stop_tokens = {s for s in self.renderer.get_stop_sequences() if isinstance(s, int)}
        tokens = [t for t in action if t not in stop_tokens]  # the end-of-message token is not an answer
        share = sum(t in self.digits for t in tokens) / len(tokens) if tokens else 0.0
        return StepResult(
            reward=share,
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(),
            metrics={"digit_share": share, "completion_tokens": len(tokens)},
        )


class DigitsGroupBuilder(EnvGroupBuilder):
    """A group of envs on one prompt (GRPO-style: rewards are centred within the group)."""

    def __init__(self, prompt: str, group_size: int, renderer: renderers.Renderer, digits: frozenset[int]) -> None:
        self.prompt = prompt
        self.group_size = group_size
        self.renderer = renderer
        self.digits = digits

    async def make_envs(self) -> Sequence[Env]:
        return [DigitsEnv(self.prompt, self.renderer, self.digits) for _ in range(self.group_size)]

    async def compute_group_rewards(
        self, trajectory_group: list[Trajectory], env_group: Sequence[Env]
    ) -> list[tuple[float, Metrics]]:
        return [(0.0, {}) for _ in trajectory_group]  # every reward comes from the env's step

    def logging_tags(self) -> list[str]:
        return ["digits"]


class DigitsDataset(RLDataset):
    """`steps` batches of `groups_per_batch` groups, cycling through PROMPTS."""

    def __init__(self, steps: int, groups_per_batch: int, group_size: int,
                 renderer: renderers.Renderer, digits: frozenset[int]) -> None:
        self.steps = steps
        self.groups_per_batch = groups_per_batch
        self.group_size = group_size
        self.renderer = renderer
        self.digits = digits

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        first = index * self.groups_per_batch
        return [DigitsGroupBuilder(PROMPTS[(first + g) % len(PROMPTS)], self.group_size, self.renderer, self.digits)
                for g in range(self.groups_per_batch)]

    def __len__(self) -> int:
        return self.steps


@chz.chz
class DigitsDatasetBuilder(RLDatasetBuilder):
    """What rl.train.Config.dataset_builder takes: the tokenizer by the model's name, the renderer by name."""

    model_name: str
    renderer_name: str = RENDERER
    steps: int = 40
    groups_per_batch: int = 4
    group_size: int = 8

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        tokenizer = get_tokenizer(self.model_name)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer)
        digits = digit_token_ids(tokenizer)
        if not digits:
            raise SystemExit(f"the tokenizer of {self.model_name} has no digit-only tokens: the digits reward needs them")
        return DigitsDataset(self.steps, self.groups_per_batch, self.group_size, renderer, digits), None


def default_model() -> str:
    """The tiny model's absolute path, as `tandem up` serves it."""
    return str(Path(TINY_MODEL).resolve())


def use_tokenizer_dir(model_name: str, tokenizer_dir: str | None) -> None:
    """Let get_tokenizer(model_name) read a local directory when the model's name is not one.

    Without one, the cookbook reads a directory by that name, else the hub (a hub id's tokenizer).
    """
    if tokenizer_dir is None:
        return
    if not Path(tokenizer_dir).is_dir():
        raise SystemExit(f"--tokenizer {tokenizer_dir}: no such directory; give one with the model's tokenizer.json")

    def load() -> Tokenizer:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir)

    register_tokenizer(model_name, load)


def build_config(args: argparse.Namespace) -> train.Config:
    """The cookbook's RL Config: sync training, no evals, periodic checkpoints every --save-every steps (0:
    only the final one)."""
    return train.Config(
        learning_rate=args.lr,
        dataset_builder=DigitsDatasetBuilder(model_name=args.model, steps=args.steps,
                                             groups_per_batch=args.groups_per_batch, group_size=args.group_size),
        model_name=args.model,
        recipe_name="tandem_digits_rl",
        max_tokens=args.max_tokens,
        log_path=args.log_path,
        renderer_name=RENDERER,
        loss_fn=args.loss_fn,
        lora_rank=args.lora_rank,
        eval_every=0,
        save_every=args.save_every,
        num_groups_to_log=0,
        rollout_json_export=False,
        base_url=args.base_url,
        max_steps=args.steps,
    )


def read_rewards(log_path: str) -> list[float]:
    """The mean reward of each step, from the cookbook's metrics.jsonl."""
    path = Path(log_path) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [float(row[REWARD_KEY]) for row in rows if REWARD_KEY in row]


async def print_progress(log_path: str) -> None:
    """A line per finished step, read from metrics.jsonl as the cookbook writes it."""
    shown = 0
    while True:
        rewards = read_rewards(log_path)
        for step in range(shown, len(rewards)):
            print(f"step {step + 1:>3}  reward {rewards[step]:.3f}", flush=True)
        shown = len(rewards)
        await asyncio.sleep(0.5)


async def run(config: train.Config) -> None:
    """The cookbook's own entry point, with a progress printer beside it."""
    printer = asyncio.create_task(print_progress(config.log_path))
    try:
        await train.main(config)
    finally:
        await asyncio.sleep(0.6)  # the last step's line
        printer.cancel()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"),
                        help="tandem's Tinker API (default: $TINKER_BASE_URL); the key is $TINKER_API_KEY")
    parser.add_argument("--model", default=None, help="base model as the stack names it (default: the tiny model's path)")
    parser.add_argument("--tokenizer", help="directory with that model's tokenizer, when --model is not one")
    parser.add_argument("--loss-fn", choices=("importance_sampling", "ppo"), default="importance_sampling")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--groups-per-batch", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=0,
                        help="the cookbook's periodic checkpoint every N steps (state and sampler weights, and a "
                             "sampling client opened on the saved path); 0: only the final one")
    parser.add_argument("--log-path", default=".tandem/tinker-rl", help="the cookbook's logs (a fresh directory: "
                        "one with checkpoints.jsonl resumes from its last checkpoint)")
    parser.add_argument("--min-rise", type=float, default=0.3, help="required rise of the reward (last 5 vs first 5 steps)")
    args = parser.parse_args(argv)
    if not args.base_url:
        parser.error("give --base-url or set TINKER_BASE_URL to tandem's Tinker API (else the SDK calls Tinker's hosted one)")
    if not os.environ.get("TINKER_API_KEY"):
        parser.error("set TINKER_API_KEY to 'tml-' + the gateway's key (any 'tml-...' on a stack without one)")
    if args.steps < 10:
        parser.error(f"--steps {args.steps}: give at least 10, the rise compares the first 5 steps with the last 5")
    args.model = args.model or default_model()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    use_tokenizer_dir(args.model, args.tokenizer)
    asyncio.run(run(build_config(args)))
    rewards = read_rewards(args.log_path)
    if len(rewards) < 10:
        print(f"FAILED: {len(rewards)} steps logged in {args.log_path}/metrics.jsonl, fewer than 10", file=sys.stderr)
        return 1
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    print(f"reward ({args.loss_fn}): first 5 steps {first:.3f} -> last 5 steps {last:.3f} (rise {last - first:+.3f})")
    if last - first < args.min_rise:
        print(f"FAILED: the reward rose by {last - first:.3f}, less than {args.min_rise}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
