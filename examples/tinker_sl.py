"""tinker-cookbook's own supervised loop, unmodified, trained against tandem's Tinker API.

The cookbook's `recipes/sl_loop.py` reads its data from the hub; its framework,
`tinker_cookbook.supervised.train.main`, takes a local JSONL file of chats through
`FromConversationFileBuilder`, which is what this runs: the 40 short chats of
examples/data/tinker_sl.jsonl (arithmetic, counting, digits), a few epochs of `cross_entropy` on
the assistant's turns. The loss (`train_mean_nll`, the mean negative log-likelihood per trained
token) falls as the LoRA adapter learns them.

The model is named as the stack names it (default: the tiny model's directory, which
`tandem up` serves under its absolute path); the renderer is picked here, `qwen3_instruct`
(ChatML, the tiny model's chat template). See examples/tinker_rl.py for why, and for --tokenizer.

    set -a; . .tandem/stack/client.env; set +a    # TINKER_BASE_URL, as `tandem up` wrote it
    export TINKER_API_KEY=tml-$TANDEM_GATEWAY__API_KEY  # the gateway's key; any tml-... on a keyless local stack
    make cookbook && .venv-cookbook/bin/python examples/tinker_sl.py --epochs 4

It prints a line per step (loss), writes the cookbook's logs under --log-path, and exits non-zero
when the loss of the last step is not below the first one's by --min-drop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinker_rl import RENDERER, default_model, use_tokenizer_dir  # noqa: E402  (the example beside this one)

DATA = Path(__file__).resolve().parent / "data" / "tinker_sl.jsonl"
LOSS_KEY = "train_mean_nll"


def build_config(args: argparse.Namespace) -> train.Config:
    """The cookbook's SL Config: a local JSONL file, constant learning rate, no evals, no periodic checkpoints."""
    dataset = FromConversationFileBuilder(
        file_path=str(args.data),
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=args.model,
            renderer_name=RENDERER,
            max_length=256,
            batch_size=args.batch_size,
        ),
    )
    return train.Config(
        log_path=args.log_path,
        model_name=args.model,
        recipe_name="tandem_chats_sl",
        renderer_name=RENDERER,
        dataset_builder=dataset,
        learning_rate=args.lr,
        lr_schedule="constant",
        num_epochs=args.epochs,
        lora_rank=args.lora_rank,
        base_url=args.base_url,
        save_every=0,
        eval_every=0,
        infrequent_eval_every=0,
    )


def read_losses(log_path: str) -> list[float]:
    """The training loss of each step, from the cookbook's metrics.jsonl."""
    path = Path(log_path) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [float(row[LOSS_KEY]) for row in rows if LOSS_KEY in row]


async def print_progress(log_path: str) -> None:
    """A line per finished step, read from metrics.jsonl as the cookbook writes it."""
    shown = 0
    while True:
        losses = read_losses(log_path)
        for step in range(shown, len(losses)):
            print(f"step {step + 1:>3}  loss {losses[step]:.4f}", flush=True)
        shown = len(losses)
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
    parser.add_argument("--data", type=Path, default=DATA, help="JSONL of {\"messages\": [...]} chats")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--log-path", default=".tandem/tinker-sl", help="the cookbook's logs (a fresh directory: "
                        "one with checkpoints.jsonl resumes from its last checkpoint)")
    parser.add_argument("--min-drop", type=float, default=0.0, help="required fall of the loss (first step - last)")
    args = parser.parse_args(argv)
    if not args.base_url:
        parser.error("give --base-url or set TINKER_BASE_URL to tandem's Tinker API (else the SDK calls Tinker's hosted one)")
    if not os.environ.get("TINKER_API_KEY"):
        parser.error("set TINKER_API_KEY to 'tml-' + the gateway's key (any 'tml-...' on a stack without one)")
    if not args.data.is_file():
        parser.error(f"--data {args.data}: no such file; give a JSONL file of chats")
    args.model = args.model or default_model()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    use_tokenizer_dir(args.model, args.tokenizer)
    asyncio.run(run(build_config(args)))
    losses = read_losses(args.log_path)
    if len(losses) < 2:
        print(f"FAILED: {len(losses)} steps logged in {args.log_path}/metrics.jsonl, fewer than 2", file=sys.stderr)
        return 1
    print(f"loss: first step {losses[0]:.4f} -> last step {losses[-1]:.4f} ({losses[-1] - losses[0]:+.4f})")
    if losses[0] - losses[-1] <= args.min_drop:
        print(f"FAILED: the loss fell by {losses[0] - losses[-1]:.4f}, not more than {args.min_drop}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
