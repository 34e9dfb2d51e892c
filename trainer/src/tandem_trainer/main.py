"""Entrypoint of the trainer service: `tandem-trainer` or `python -m tandem_trainer.main`.

Thin on purpose: parse settings, set up logging, print the resolved settings (secrets
redacted), connect to Redis; only then import the heavy parts (torch, peft) and serve.
SIGTERM or Ctrl+C asks for a warm shutdown: the current job finishes, then the worker exits.

With more than one rank (`parallel.ranks`, or several `gpus.trainer` in split mode, or several
`parallel.nodes`) this process becomes torchrun (launcher.py), which starts this entrypoint
again once per rank (parallel.py): rank 0 serves the queue, the others follow its orders
(step.py). A configuration error in a rank ends the trainer (exit 2) instead of a restart.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.settings import GpuSettings, TrainerSettings

log = logging.getLogger("tandem_trainer")


def trainer_gpus(gpus: GpuSettings) -> str | None:
    """CUDA_VISIBLE_DEVICES for the trainer: its own GPUs (split), the engine's (shared), none (cpu)."""
    if gpus.mode == "split":
        return ",".join(str(g) for g in gpus.trainer)
    if gpus.mode == "shared":
        return str(gpus.inference[0])
    return None


def main(argv: list[str] | None = None) -> None:
    """Run the trainer worker until it is asked to stop; `--burst` exits when the queue is empty."""

    from tandem import logs
    from tandem.errors import ConfigError, TandemError
    from tandem.settings import TrainerSettings, load, service_arguments

    args = sys.argv[1:] if argv is None else argv
    service_arguments("tandem-trainer", "trainer", "The trainer worker: takes training jobs off the queue, trains "
                      "the LoRA adapters and publishes each version.", args,
                      flags={"--burst": "exit once the queue is empty instead of waiting for jobs"})
    logs.configure()
    try:
        settings = load(TrainerSettings)
    except ConfigError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    name = settings.worker_name or f"{socket.gethostname()}.{os.getpid()}"
    ranks = settings.parallel.world(settings.gpus)
    gpus = trainer_gpus(settings.gpus)
    if gpus is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus  # before torch is imported
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # bars are noise in service logs
    if settings.parallel.total(settings.gpus) > 1 and not launched():
        from tandem_trainer.launcher import launch, preflight

        try:
            preflight(settings, ranks)
        except TandemError as exc:  # before torchrun: it would start the ranks again and again
            log.error("trainer cannot run: %s", exc)
            raise SystemExit(2) from exc
        launch(settings, ranks, args)
        return
    log.info("trainer.settings worker=%s %s", name, json.dumps(settings.redacted(), sort_keys=True))
    try:
        if launched():
            run_rank(settings, name, burst="--burst" in args)
            return
        conn = settings.redis.connect()
        from tandem_trainer.worker import serve  # heavy: torch, transformers, peft

        serve(settings, conn, name, burst="--burst" in args)
    except ConfigError as exc:
        log.error("trainer cannot run: %s", exc)
        if launched():  # the launcher stops every rank instead of starting them again
            from tandem_trainer.launcher import CONFIG_ERROR_EXIT, report_config_error

            report_config_error(str(exc))
            raise SystemExit(CONFIG_ERROR_EXIT) from exc
        raise SystemExit(1) from exc
    except TandemError as exc:
        log.error("trainer cannot run: %s", exc)
        raise SystemExit(1) from exc


# data-parallel ranks ------------------------------------------------------------
def launched() -> bool:
    """Whether this process is a rank that torchrun started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def run_rank(settings: TrainerSettings, name: str, *, burst: bool) -> None:
    """One rank under torchrun: rank 0 serves the queue, the others follow it. A rank that lost
    the others exits with 1, so that torchrun starts every rank again."""
    from tandem_trainer.backends.select import resolve_device
    from tandem_trainer.parallel import Group

    device = resolve_device(settings.backend.device)
    group = Group.start(settings, device)
    try:
        if group.rank == 0:
            from tandem_trainer.worker import serve

            try:
                serve(settings, settings.redis.connect(), name, burst=burst, group=group)
            finally:  # rq's warm-shutdown handler has nothing left to stop
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            from tandem_trainer.step import follow

            signal.signal(signal.SIGTERM, lambda signum, frame: log.info(
                "rank %d: SIGTERM; stopping when rank 0 does", group.rank))
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            follow(settings, group)
    finally:
        group.close()
    if group.broken:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
