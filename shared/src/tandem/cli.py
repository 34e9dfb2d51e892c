"""The `tandem` command: start the local stack, show settings, show runs.

    tandem up [--model PATH] [--gateway-port 8000]     start everything as local processes
    tandem settings trainer|inference|client            resolved settings, secrets redacted
    tandem settings --markdown                          the configuration reference (docs/configuration.md)
    tandem status [RUN]                                 runs, versions, what serves
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem.settings import SERVICES, ClientSettings, settings_markdown

TINY_MODEL = ".tandem/models/tiny"


def ensure_tiny_model(path: str) -> None:
    """Build the tiny model with the trainer package (which has torch) if it is missing."""
    if (Path(path) / "config.json").exists():
        return
    subprocess.run([sys.executable, "-m", "tandem_trainer.tiny_model", path], check=True)


def cmd_up(args: argparse.Namespace) -> int:
    from tandem.stack import Stack, StackConfig

    if args.model == TINY_MODEL:
        ensure_tiny_model(args.model)
    stack = Stack(StackConfig(state_dir=Path(args.state_dir), model=args.model, gateway_port=args.gateway_port,
                              redis_port=args.redis_port))
    stack.start()
    print(f"tandem is up: gateway {stack.gateway_url}, redis {stack.redis_url}, logs in {stack.logs}")
    print("Ctrl-C stops every service.")
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stopping:
            for svc in stack.services:
                if svc.proc is not None and svc.proc.poll() is not None:
                    print(f"{svc.name} exited with code {svc.proc.returncode}; see {svc.log_path}", file=sys.stderr)
                    stopping = True
            time.sleep(0.5)
    finally:
        print("stopping ...")
        stack.stop()
    return 0


def cmd_settings(args: argparse.Namespace) -> int:
    if args.markdown:
        print(settings_markdown(), end="")
        return 0
    if not args.service:
        print("name a service (trainer, inference, client) or pass --markdown", file=sys.stderr)
        return 2
    print(json.dumps(SERVICES[args.service]().redacted(), indent=2))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from tandem.registry import Registry

    reg = Registry(ClientSettings().redis.connect())
    for name in [args.run] if args.run else reg.list_runs():
        spec = reg.get_run(name)
        print(f"{name}: base {spec.base_model}, latest v{reg.latest_version(name)}, serving v{reg.serving(name)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the stack as local processes")
    up.add_argument("--model", default=TINY_MODEL, help="base model (default: the tiny model, built if missing)")
    up.add_argument("--state-dir", default=".tandem/stack", help="logs, adapters and Redis data")
    up.add_argument("--gateway-port", type=int, default=8000)
    up.add_argument("--redis-port", type=int, default=0, help="0 = a free port")
    up.set_defaults(func=cmd_up)
    st = sub.add_parser("settings", help="print resolved settings, secrets redacted")
    st.add_argument("service", nargs="?", choices=sorted(SERVICES))
    st.add_argument("--markdown", action="store_true", help="print the configuration reference of every service")
    st.set_defaults(func=cmd_settings)
    status = sub.add_parser("status", help="runs, their newest and serving versions")
    status.add_argument("run", nargs="?")
    status.set_defaults(func=cmd_status)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
