"""Failpoints: named places where the trainer kills itself, a test hook for crash recovery.

`TANDEM_TRAINER_FAILPOINTS=after_register` (a comma-separated list of names from `POINTS`)
makes the trainer send itself SIGKILL when it reaches that place, as an OOM kill or a power
cut would: no cleanup, no `finally`. The kill tests use it to stop a trainer at an exact
moment instead of racing it. `mid_training@rank1` arms a point in one data-parallel rank only,
and only in the ranks torchrun starts first (not after a restart), so that a test can kill
one rank once. The variable is read once, when this module is imported; unset, each point
costs one lookup in an empty set. Leave it unset in production.
"""

from __future__ import annotations

import logging
import os
import signal

from tandem_trainer.errors import TrainerConfigError

log = logging.getLogger(__name__)

ENV = "TANDEM_TRAINER_FAILPOINTS"

#: Every point, in the order a job passes them.
POINTS = (
    "after_dequeue",      # rq took the job from the queue (its intermediate list); not started yet
    "job_started",        # rq marked the job started; the train function begins
    "lock_taken",         # the run's lock is held
    "mid_training",       # after the first micro-batch's backward pass
    "staging_created",    # the version's staging directory exists, empty
    "weights_written",    # the adapter is in the staging directory; no manifest, not renamed
    "after_rename",       # the version is renamed into place; not registered
    "after_register",     # registered in Redis; `adapter_ready` not appended
    "after_announce",     # `adapter_ready` appended; the version's files not fsynced yet
    "after_sync",         # the version's files fsynced; trainer state not written
    "state_written",      # trainer state written to its staging directory; not renamed
    "after_state",        # trainer state in place; the job function has not returned
    "before_finish",      # the job function returned; rq has not stored the result
)


def _armed(raw: str) -> frozenset[str]:
    items = [item.strip() for item in raw.split(",") if item.strip()]
    named = [item.partition("@rank") for item in items]
    unknown = sorted({name for name, _, _ in named} - set(POINTS))
    if unknown:
        raise TrainerConfigError(f"{ENV}: unknown failpoint(s) {unknown}; known: {', '.join(POINTS)}")
    for item, (_, _, rank) in zip(items, named, strict=True):
        if rank and not rank.isdigit():
            raise TrainerConfigError(f"{ENV}: {item!r}: a rank is a number, as in mid_training@rank1")
    this_rank = os.environ.get("RANK", "0") if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else None
    return frozenset(name for name, _, rank in named if not rank or rank == this_rank)


ARMED = _armed(os.environ.get(ENV, ""))


def hit(name: str) -> None:
    """Kill this process (SIGKILL) if the failpoint `name` is armed."""
    if name in ARMED:
        log.warning("failpoint %s: the trainer kills itself (SIGKILL)", name)
        os.kill(os.getpid(), signal.SIGKILL)
