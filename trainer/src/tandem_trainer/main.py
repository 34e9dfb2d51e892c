"""Entrypoint of the trainer service: `tandem-trainer` or `python -m tandem_trainer.main`.

Thin on purpose: parse settings, set up logging, print the resolved settings (secrets
redacted), connect to Redis; only then import the heavy parts (torch, peft) and serve.
SIGTERM or Ctrl+C asks for a warm shutdown: the current job finishes, then the worker exits.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.settings import GpuSettings

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
    log.info("trainer.settings worker=%s %s", name, json.dumps(settings.redacted(), sort_keys=True))
    try:
        conn = settings.redis.connect()
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # bars are noise in service logs
        gpus = trainer_gpus(settings.gpus)
        if gpus is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus  # before torch is imported
        from tandem_trainer.worker import serve  # heavy: torch, transformers, peft

        serve(settings, conn, name, burst="--burst" in args)
    except TandemError as exc:
        log.error("trainer cannot run: %s", exc)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
