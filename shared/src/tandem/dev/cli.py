"""The `tandem` command: start the local stack, show settings, show runs.

    tandem up [--model PATH] [--gateway-port 8000] [--replicas N]
                                                        start everything as local processes
    tandem settings trainer|inference|client|tinker     resolved settings, secrets redacted
    tandem settings --markdown                          the configuration reference (docs/configuration.md)
    tandem status [RUN] [--state-dir DIR]               runs, versions, what serves
    tandem delete RUN [--state-dir DIR]                 delete a run: its versions, queued jobs, episodes

status and delete reach the stack through the client's settings: the environment, `.env`, and the
client.env of `tandem up` (its default state directory's, or the one --state-dir names).

Expected failures (Redis away, a port taken, an unknown run) print one line that says what
to do, and the command exits with 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from pydantic import SecretStr, ValidationError

from tandem.dev.settings_reference import settings_markdown
from tandem.errors import BackendUnavailable, ConfigError, TandemError, ValidationFailed
from tandem.runs import check_run_name, missing_model_directory
from tandem.settings import LOCAL_STACK_ENV, SERVICES, ClientSettings, load, redact_url

TINY_MODEL = ".tandem/models/tiny"


def ensure_tiny_model(path: str) -> None:
    """Build the tiny model with the trainer package (which has torch) unless it is there already.

    The builder decides: it reuses a build whose recipe is current and rebuilds one from an older
    recipe (its stamp's format version), without importing torch to find out.
    """
    try:
        subprocess.run([sys.executable, "-m", "tandem_trainer.tiny_model", path], check=True,
                       stdout=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ConfigError(
            f"could not build the tiny model at {path} ({exc}); is tandem-trainer installed (`make install`)? "
            "or pass --model PATH"
        ) from exc


def _replicas(raw: str) -> int:
    """--replicas: a whole number from 1 to 16."""
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 16:
        raise argparse.ArgumentTypeError(f"--replicas {raw!r}: give a whole number from 1 to 16")
    return n


def _run_name(raw: str) -> str:
    """tandem status RUN, tandem delete RUN: a valid run name (an empty one is not "every run")."""
    try:
        return check_run_name(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _port(raw: str) -> int:
    """--gateway-port, --redis-port, --tinker-port: 0 (a free one) to 65535."""
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{raw!r}: give a port from 1 to 65535, or 0 for a free one")
    return n


def cmd_up(args: argparse.Namespace) -> int:
    from tandem.dev.composition import StackConfig
    from tandem.dev.stack import Stack

    _check_paths(args)
    for service in SERVICES.values():  # a bad TANDEM_* value: one line now, not a service dying at start
        load(service)
    stack = Stack(StackConfig(state_dir=Path(args.state_dir), model=args.model, gateway_port=args.gateway_port,
                              redis_port=args.redis_port, tinker_port=args.tinker_port, replicas=args.replicas))
    stack.supervisor.open()  # the state directory first: a second `tandem up` on it is refused before any work
    if args.model == TINY_MODEL:
        try:
            ensure_tiny_model(args.model)
        except BaseException:
            stack.stop()
            raise
    for sig in (signal.SIGINT, signal.SIGTERM):  # both stop the stack, even where a shell ignored SIGINT (`&`)
        signal.signal(sig, _interrupt)
    try:
        stack.start()
        client_env = stack.state / "client.env"
        if client_env == Path(LOCAL_STACK_ENV).resolve():
            found = f"tandem.Client() and `tandem status` run from this directory use both ({LOCAL_STACK_ENV})"
        else:
            found = (f"{_shown_path(client_env)} has both: `set -a; . {_shown_path(client_env)}; set +a` exports them, "
                     f"and `tandem status --state-dir {_shown_path(stack.state)}` reads it")
        print(f"tandem is up (logs in {_shown_path(stack.logs)}):\n"
              f"  gateway  {stack.gateway_url}\n"
              f"  redis    {redact_url(stack.redis_url)} (the client's user; the full URL, with its password, is in "
              f"{_shown_path(client_env)}; the admin's password is in {_shown_path(stack.state / 'secrets.json')})\n"
              f"  metrics  {stack.gateway_url}/metrics (gateway), "
              f"http://127.0.0.1:{stack.trainer_metrics_port}/metrics (trainer)\n"
              + (f"  tinker   {stack.tinker_url} (tinker.ServiceClient(base_url=...), api_key='tml-' + the gateway's "
                 "key, or any tml- key without one)\n" if stack.tinker_url else "")
              + f"{found};\n"
              f"elsewhere: Client(gateway_url, redis_url) with the URLs from {_shown_path(client_env)}.\n"
              "A service that dies is started again. Ctrl-C stops every service.", flush=True)
        stack.supervise(lambda: False)
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        if stack.services:
            print("stopping ...", file=sys.stderr)
        stack.stop()
    return 0


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse, before anything starts, a --state-dir that is a file and a --model directory that is not there."""
    state = Path(args.state_dir)
    blocking = next((p for p in (state, *state.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ConfigError(f"--state-dir {args.state_dir}: {blocking} is a file, not a directory; "
                          "give a directory (it is made if missing)")
    if args.model != TINY_MODEL and missing_model_directory(args.model):
        raise ConfigError(f"--model {args.model}: no such directory; give a model directory (config.json, "
                          "tokenizer and weights), a hub id, or leave --model out for the tiny model")


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _shown_path(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def cmd_settings(args: argparse.Namespace) -> int:
    if args.markdown:
        print(settings_markdown(), end="")
        return 0
    if not args.service:
        print(f"name a service ({', '.join(sorted(SERVICES))}) or pass --markdown", file=sys.stderr)
        return 2
    print(json.dumps(load(SERVICES[args.service]).redacted(), indent=2))
    return 0


def _client_settings(args: argparse.Namespace) -> ClientSettings:
    """The client's settings; with --state-dir DIR, the gateway and Redis URLs of DIR's client.env
    (what `tandem up --state-dir DIR` wrote), over the environment's: the flag names the stack,
    even in a shell that exported another stack's URLs. Its gateway's API key, which client.env
    has when the gateway has one, applies unless the environment gives one."""
    settings = load(ClientSettings)
    if args.state_dir is None:
        return settings
    env = Path(args.state_dir) / "client.env"
    if not env.is_file():
        raise ConfigError(f"--state-dir {args.state_dir}: no client.env there; give the directory that "
                          "`tandem up --state-dir` was given (it writes client.env when the stack is up)")
    lines = env.read_text().splitlines()  # as composition.py writes it: KEY=VALUE, unquoted
    values = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    gateway, redis_url = values.get("TANDEM_GATEWAY_URL"), values.get("TANDEM_REDIS__URL")
    if not gateway or not redis_url:
        raise ConfigError(f"--state-dir {args.state_dir}: {env} lacks TANDEM_GATEWAY_URL or TANDEM_REDIS__URL; "
                          "start the stack again with `tandem up --state-dir` (it writes both)")
    update: dict[str, object] = {"gateway_url": gateway,
                                 "redis": settings.redis.model_copy(update={"url": redis_url})}
    if settings.api_key is None and values.get("TANDEM_API_KEY"):
        update["api_key"] = SecretStr(values["TANDEM_API_KEY"])
    return settings.model_copy(update=update)


def _env_source(args: argparse.Namespace) -> str:
    return str(Path(args.state_dir) / "client.env") if args.state_dir else LOCAL_STACK_ENV


def _pointing_at_source(exc: TandemError, args: argparse.Namespace, what: str) -> TandemError:
    """`exc` again, saying where the stack's `what` came from: a stack that is not up, or another one."""
    return type(exc)(f"{exc} (`tandem up` writes its {what} to {_env_source(args)}; is that stack up?)")


def cmd_status(args: argparse.Namespace) -> int:
    from tandem.registry import Registry
    from tandem.replicas import Replicas

    settings = _client_settings(args)
    try:
        reg = Registry(settings.redis.connect())
    except (BackendUnavailable, ConfigError) as exc:  # Redis away, or a password from an older client.env
        raise _pointing_at_source(exc, args, "Redis URL") from exc
    names = [args.run] if args.run else reg.list_runs()
    if not names:
        print(f"no runs yet in Redis at {redact_url(settings.redis.url)}")
    for name in names:
        try:
            base = reg.get_run(name).base_model
        except ValidationFailed as exc:  # one unreadable run spec must not hide the others
            print(f"{name}: {exc}")
            continue
        print(f"{name}: base {base}, latest v{reg.latest_version(name)}, serving v{reg.serving(name)}")
    for replica in Replicas(reg.conn, prune=False).live():
        runs = [f"{run} v{held.serving} (loaded {', '.join(f'v{v}' for v in held.loaded) or 'none'})"
                for run, held in sorted(replica.runs.items()) if not args.run or run == args.run]
        print(f"replica {replica.id} at {replica.url}: {'ready' if replica.ready else 'NOT READY'}"
              f"{'; ' + '; '.join(runs) if runs else ''}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """Delete a run through the gateway (TANDEM_GATEWAY_URL, TANDEM_API_KEY), as `Client.delete_run` does."""
    from tandem.client import Client

    settings = _client_settings(args)
    try:
        with Client(settings=settings) as client:
            deleted = client.delete_run(args.run)
    except BackendUnavailable as exc:  # the stack is not up, or elsewhere
        raise _pointing_at_source(exc, args, "URLs") from exc
    print(f"deleted run {deleted.run}: {len(deleted.versions)} versions (the trainer removes their files from the "
          f"adapter store), {len(deleted.jobs)} queued jobs, {deleted.episodes} episodes; its events stay in the stream")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is not the command's output
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the stack as local processes")
    up.add_argument("--model", default=TINY_MODEL, help="base model (default: the tiny model, built if missing)")
    up.add_argument("--state-dir", default=".tandem/stack", help="logs, adapters and Redis data")
    up.add_argument("--gateway-port", type=_port, default=8000, help="0 = a free port")
    up.add_argument("--redis-port", type=_port, default=0, help="0 = a free port")
    up.add_argument("--tinker-port", type=_port, default=0,
                    help="the Tinker API's port, where the tinker package is installed (0 = a free port)")
    up.add_argument("--replicas", type=_replicas, default=1,
                    help="inference replicas, each with its own engine, behind the router (HAProxy) on the gateway port")
    up.set_defaults(func=cmd_up)
    st = sub.add_parser("settings", help="print resolved settings, secrets redacted")
    st.add_argument("service", nargs="?", choices=sorted(SERVICES))
    st.add_argument("--markdown", action="store_true", help="print the configuration reference of every service")
    st.set_defaults(func=cmd_settings)
    status = sub.add_parser("status", help="runs, their newest and serving versions")
    status.add_argument("run", nargs="?", type=_run_name, help="one run (default: every run)")
    status.add_argument("--state-dir", help=f"a stack started with `tandem up --state-dir DIR` (default: {LOCAL_STACK_ENV})")
    status.set_defaults(func=cmd_status)
    delete = sub.add_parser("delete", help="delete a run (refused while a job of it runs)")
    delete.add_argument("run", type=_run_name, help="the run")
    delete.add_argument("--state-dir", help=f"a stack started with `tandem up --state-dir DIR` (default: {LOCAL_STACK_ENV})")
    delete.set_defaults(func=cmd_delete)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `tandem status | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 1
    except TandemError as exc:
        print(f"tandem {args.cmd}: {exc}", file=sys.stderr)
    except ValidationError as exc:  # settings from the environment that do not parse
        print(f"tandem {args.cmd}: invalid settings: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
