"""What the examples share: their stack arguments, the tokenizer they read, and the client.

An example either starts the whole stack as local processes or, with --gateway and --redis,
trains against a stack that is already running (e.g. the containers). Either way it gets a
`Client`; the local stack is stopped when the example's `ExitStack` closes.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import ExitStack
from pathlib import Path

from tandem.client import Client
from tandem.dev.cli import TINY_MODEL, ensure_tiny_model
from tandem.dev.composition import StackConfig
from tandem.dev.stack import Stack


def add_stack_arguments(parser: argparse.ArgumentParser, *, out: str, run: str, min_rise: float) -> None:
    """--model, --out, --min-rise, --gateway, --redis, --tokenizer and --run, with these defaults."""
    parser.add_argument("--model", default=TINY_MODEL, help="base model (default: the tiny model, built if missing)")
    parser.add_argument("--out", default=out, help="state, logs and results")
    parser.add_argument("--min-rise", type=float, default=min_rise,
                        help="required rise of the reward (last 5 vs first 5 steps)")
    parser.add_argument("--gateway", help="URL of a running stack's gateway: start no stack, use that one")
    parser.add_argument("--redis", help="that stack's Redis URL (with its password), for train(); needs --gateway "
                        "(default: TANDEM_REDIS__URL, which keeps the password off the command line)")
    parser.add_argument("--tokenizer", help="directory with the model's tokenizer.json (default: the model's own)")
    parser.add_argument("--run", default=run, help="run name (a new name starts from the base model)")


def parse_stack_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, refuse --gateway without a Redis URL (--redis, or TANDEM_REDIS__URL) and --redis without
    --gateway, and build the tiny model if it is used."""
    args = parser.parse_args()
    if args.gateway and not args.redis:
        args.redis = os.environ.get("TANDEM_REDIS__URL")
    if bool(args.gateway) != bool(args.redis):
        parser.error("--gateway and --redis go together: a running stack's gateway and its Redis (--redis, or "
                     "TANDEM_REDIS__URL in the environment)")
    if TINY_MODEL in (args.model, args.tokenizer):
        print("building the tiny model (seeded, a few seconds) ...", flush=True)
        ensure_tiny_model(TINY_MODEL)
    return args


def tokenizer_dir(model: str, tokenizer: str | None) -> Path:
    """A directory with the model's tokenizer.json: --tokenizer, the model's own, or the hub's."""
    if tokenizer:
        return Path(tokenizer)
    if (Path(model) / "tokenizer.json").exists():
        return Path(model)
    if model.startswith(("/", ".")):
        raise SystemExit(f"no tokenizer.json in {model} on this machine (a path inside the containers?); "
                         "pass --tokenizer DIR with the same model's tokenizer.json")
    from huggingface_hub import hf_hub_download  # comes with transformers (`make install`)

    return Path(hf_hub_download(model, "tokenizer.json")).parent


def open_client(stack: ExitStack, args: argparse.Namespace) -> Client:
    """A client of the stack at --gateway/--redis, or of a local stack started under --out."""
    if args.gateway:
        print(f"using the stack at {args.gateway}", flush=True)
        gateway_url, redis_url = args.gateway, args.redis
    else:
        state = Path(args.out) / f"stack-{int(time.time())}"
        print(f"starting the stack (logs in {state}/logs) ...", flush=True)
        local = stack.enter_context(Stack(StackConfig(state_dir=state, model=args.model, gateway_port=0)))
        gateway_url, redis_url = local.gateway_url, local.redis_url
    client = Client(gateway_url, redis_url)
    stack.callback(client.close)
    return client


def base_model(args: argparse.Namespace) -> str:
    """The run's base model: the local path resolved when the stack is local, else as the stack names it."""
    local_model = Path(args.model).exists() and not args.gateway
    return str(Path(args.model).resolve()) if local_model else str(args.model)
