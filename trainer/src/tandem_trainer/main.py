"""Entrypoint of the trainer service: `tandem-trainer` or `python -m tandem_trainer.main`.

Thin on purpose: parse settings, set up logging, print the resolved settings (secrets
redacted), connect to Redis; only then import the heavy parts (torch, peft) and serve.
SIGTERM or Ctrl+C asks for a warm shutdown: the current job finishes, then the worker exits.

With more than one rank (`parallel.ranks`, or several `gpus.trainer` in split mode) this
process becomes torchrun, which starts this entrypoint again once per rank (parallel.py):
rank 0 serves the queue, the others follow its orders (step.py).
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
    from pydantic import ValidationError

    from tandem.errors import TandemError
    from tandem.settings import TrainerSettings

    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        settings = TrainerSettings()
    except ValidationError as exc:
        log.error("invalid trainer settings: %s", exc)
        raise SystemExit(2) from exc
    name = settings.worker_name or f"{socket.gethostname()}.{os.getpid()}"
    ranks = settings.parallel.world(settings.gpus)
    gpus = trainer_gpus(settings.gpus)
    if gpus is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus  # before torch is imported
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # bars are noise in service logs
    if ranks > 1 and not launched():
        try:
            check_devices(settings, ranks)
        except TandemError as exc:  # before torchrun: it would start the ranks again and again
            log.error("trainer cannot run: %s", exc)
            raise SystemExit(2) from exc
        launch(ranks, settings.parallel.max_restarts, args)
        return
    log.info("trainer.settings worker=%s %s", name, json.dumps(settings.redacted(), sort_keys=True))
    try:
        if launched():
            run_rank(settings, name, burst="--burst" in args)
            return
        conn = settings.redis.connect()
        from tandem_trainer.worker import serve  # heavy: torch, transformers, peft

        serve(settings, conn, name, burst="--burst" in args)
    except TandemError as exc:
        log.error("trainer cannot run: %s", exc)
        raise SystemExit(1) from exc


# data-parallel ranks ------------------------------------------------------------
#: How long torchrun gives the ranks to stop after SIGTERM before it kills them, in seconds: room
#: for the job in flight to finish (compose gives the trainer 600 s to stop).
SHUTDOWN_TIMEOUT_S = 570


def launched() -> bool:
    """Whether this process is a rank that torchrun started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def torchrun_args(ranks: int, max_restarts: int, args: list[str]) -> list[str]:
    """torchrun's arguments for `ranks` trainer processes on this machine."""
    return [
        "--standalone", f"--nproc-per-node={ranks}", f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5", "--module", "tandem_trainer.main", *args,
    ]


def check_devices(settings: TrainerSettings, ranks: int) -> None:
    """Each rank of a CUDA trainer in split mode needs a GPU of its own."""
    from tandem_trainer.backends.select import resolve_device
    from tandem_trainer.errors import TrainerConfigError

    if settings.gpus.mode != "split" or resolve_device(settings.backend.device) != "cuda":
        return
    import torch

    if torch.cuda.device_count() < ranks:
        raise TrainerConfigError(
            f"{ranks} trainer ranks but torch sees {torch.cuda.device_count()} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); give the trainer "
            "as many GPUs as parallel.ranks (in a container: its GPU reservation and CUDA_VISIBLE_DEVICES)"
        )


def launch(ranks: int, max_restarts: int, args: list[str]) -> None:
    """Run torchrun (in this process) until its ranks end: on SIGTERM or Ctrl+C it stops them
    (warm: rank 0 finishes its job) and this returns; when they fail more often than
    `max_restarts`, this exits with 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.update(launch_env())
    argv = torchrun_args(ranks, max_restarts, args)
    log.info("trainer.launch ranks=%d CUDA_VISIBLE_DEVICES=%s torchrun %s",
             ranks, os.environ.get("CUDA_VISIBLE_DEVICES"), " ".join(argv))
    try:
        run(parse_args(argv))  # type: ignore[no-untyped-call]  # torch leaves torchrun's API untyped
    except SignalException as exc:
        log.info("trainer.stopped %s; every rank has stopped", exc)
    except ChildFailedError as exc:
        log.error("the trainer's ranks failed once more than parallel.max_restarts=%d allows; exiting:\n%s",
                  max_restarts, exc.format_msg())  # type: ignore[no-untyped-call]
        raise SystemExit(1) from exc


def launch_env() -> dict[str, str]:
    """Environment of torchrun and its ranks: collectives on loopback, time for a warm shutdown."""
    return {
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S)),
    }


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
