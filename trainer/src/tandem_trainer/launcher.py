"""Starting the data-parallel ranks: torchrun in this process, on one machine or on several.

`tandem-trainer` with more than one rank in its group (`parallel.ranks` on this machine times
`parallel.nodes`) runs torchrun here (`launch`), which starts `tandem_trainer.main` once per
local rank and starts them all again when one fails (parallel.py says what the ranks do).

The ranks meet at torchrun's c10d rendezvous, whose store this process hosts when it is this
machine's to host, listening on one address only (rendezvous.py); torchrun joins it as a client.
The ranks' own store is new at every start (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: rank 0 hosts
it on a fresh port, on its node's address; torchrun's agent would host one on every interface).

- One machine: the rendezvous is on a free port of loopback; gloo and NCCL stay on `lo`.
- Several machines (`parallel.nodes > 1`): every node runs `tandem-trainer` with the same
  settings and they meet at `parallel.rendezvous_endpoint`: the node whose address that is hosts
  the store, the others wait for it to answer. A start of the ranks is named by its store's
  address (parallel.py), since the nodes' restart counts differ (a node restarts its ranks without
  counting a restart when another node's rank failed). When the nodes lose each other around the
  rendezvous (a node stops just after joining a round, or the store's host stops), torchrun raises
  a store error on the node left; that node goes back to the rendezvous and waits for the others
  (`rendezvous.lost`), at most `max_restarts` times, instead of exiting.

What cannot work is found before any rank starts (`preflight`: the GPUs, the backend, Redis),
and a configuration error that only a rank meets (`ConfigError`: a worker name in use, a
backend that cannot load) ends the trainer instead of being restarted `max_restarts` times:
the rank writes its message to the file `TANDEM_TRAINER_CONFIG_ERROR_FILE` names and exits
with `CONFIG_ERROR_EXIT`; the launcher sees the file, stops every rank and exits with 2.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.settings import ParallelSettings, TrainerSettings
    from tandem_trainer.rendezvous import Rendezvous

log = logging.getLogger("tandem_trainer")

#: How long torchrun gives the ranks to stop after SIGTERM before it kills them, in seconds: room
#: for the job in flight to finish (compose gives the trainer 600 s to stop).
SHUTDOWN_TIMEOUT_S = 570
#: The exit status of a rank that met a configuration error (the launcher exits with 2).
CONFIG_ERROR_EXIT = 3
#: The file a rank writes its configuration error to, for the launcher.
CONFIG_ERROR_FILE_ENV = "TANDEM_TRAINER_CONFIG_ERROR_FILE"


def torchrun_args(parallel: ParallelSettings, ranks: int, args: list[str], endpoint: str) -> list[str]:
    """torchrun's arguments for `ranks` trainer processes on this machine, alone or as one node of
    `parallel.nodes`, meeting at the rendezvous at `endpoint` (`Rendezvous.endpoint`)."""
    alone = parallel.rendezvous_endpoint is None
    address = "127.0.0.1" if alone else parallel.node_address
    return [
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={parallel.rendezvous_id}",
        f"--nnodes={parallel.nodes}",
        # the launcher hosts the store (rendezvous.py): torchrun only joins it
        f"--rdzv-conf=join_timeout={parallel.rendezvous_timeout_s},"
        f"read_timeout={parallel.rendezvous_read_timeout_s},is_host=false",
        *([f"--local-addr={address}"] if address is not None else []),
        f"--nproc-per-node={ranks}", f"--max-restarts={parallel.max_restarts}",
        "--monitor-interval=0.5", "--module", "tandem_trainer.main", *args,
    ]


def launch_env(parallel: ParallelSettings) -> dict[str, str]:
    """Environment of torchrun and its ranks: on one machine the collectives stay on loopback;
    on several they take the interface of the host name (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    choose another). The ranks' store is new at every start, hosted by rank 0 (parallel.py)
    instead of torchrun's agent, which would listen on every interface."""
    env = {
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S)),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    if parallel.nodes == 1:
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", "lo")
    return env


def preflight(settings: TrainerSettings, ranks: int) -> None:
    """What the ranks would fail on at once, and again at every restart: each rank of a CUDA
    trainer in split mode needs a GPU of its own, `backend.kind=unsloth` needs Unsloth and CUDA,
    and Redis must answer (waited for up to `redis_outage_s`, as a single trainer does)."""
    from tandem_trainer.backends.select import resolve_device, unsloth_problem
    from tandem_trainer.errors import TrainerConfigError, TrainingBackendMissing
    from tandem_trainer.outage import ride_out_outages

    device = resolve_device(settings.backend.device)
    if settings.gpus.mode == "split" and device == "cuda":
        import torch

        if torch.cuda.device_count() < ranks:
            raise TrainerConfigError(
                f"{ranks} trainer ranks but torch sees {torch.cuda.device_count()} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); give the trainer "
                "as many GPUs as parallel.ranks (in a container: its GPU reservation and CUDA_VISIBLE_DEVICES)"
            )
    if settings.backend.kind == "unsloth":
        problem = unsloth_problem(device)
        if problem is not None:
            raise TrainingBackendMissing(
                f"backend.kind='unsloth' cannot be used: {problem}; set TANDEM_BACKEND__KIND=peft (or auto)"
            )
    from tandem.connection import translated

    conn = ride_out_outages(settings.redis.connect(), settings.redis_outage_s)
    with translated(conn, "reach Redis before starting the ranks"):
        conn.ping()


def report_config_error(message: str) -> None:
    """A rank: tell the launcher that this start cannot work (see the module's docstring)."""
    path = os.environ.get(CONFIG_ERROR_FILE_ENV)
    if path:
        Path(path).write_text(f"rank {os.environ.get('RANK', '?')}: {message}")


class _ConfigErrorWatch:
    """Stops torchrun (SIGTERM to this process: torchrun stops every rank) once a rank reported a
    configuration error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.message: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="config-error-watch", daemon=True)

    def __enter__(self) -> _ConfigErrorWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)
        if self.message is None and self.path.is_file():  # written as the ranks ended
            self.message = self.path.read_text()

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            if self.path.is_file():
                time.sleep(0.1)  # let the rank finish writing
                self.message = self.path.read_text()
                os.kill(os.getpid(), signal.SIGTERM)
                return


def launch(settings: TrainerSettings, ranks: int, args: list[str]) -> None:
    """Run torchrun (in this process) until its ranks end: on SIGTERM or Ctrl+C it stops them
    (warm: rank 0 finishes its job) and this returns; when a rank met a configuration error this
    exits with 2; when they fail more often than `max_restarts`, or the other nodes do not come to
    the rendezvous in time, with 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from tandem_trainer.errors import RendezvousFailed
    from tandem_trainer.rendezvous import Rendezvous

    parallel = settings.parallel
    scratch = Path(tempfile.mkdtemp(prefix="tandem-launch-"))
    marker = scratch / "config-error"
    os.environ.update(launch_env(parallel))
    os.environ[CONFIG_ERROR_FILE_ENV] = str(marker)
    rendezvous = Rendezvous.of(parallel)
    argv = torchrun_args(parallel, ranks, args, rendezvous.endpoint)
    log.info("trainer.launch ranks=%d nodes=%d CUDA_VISIBLE_DEVICES=%s torchrun %s",
             ranks, parallel.nodes, os.environ.get("CUDA_VISIBLE_DEVICES"), " ".join(argv))
    with _ConfigErrorWatch(marker) as watch:
        try:
            failed = _torchrun(parallel, rendezvous, argv, watch)
        finally:
            os.environ.pop(CONFIG_ERROR_FILE_ENV, None)
    shutil.rmtree(scratch, ignore_errors=True)
    if watch.message is not None:
        log.error("trainer cannot run: %s; every rank has stopped (a configuration error is not restarted)",
                  watch.message)
        raise SystemExit(2)
    if isinstance(failed, RendezvousFailed):
        log.error("trainer.rendezvous_failed %s; exiting", failed)
        raise SystemExit(1) from failed
    if isinstance(failed, ChildFailedError):
        log.error("the trainer's ranks failed once more than parallel.max_restarts=%d allows; exiting:\n%s",
                  parallel.max_restarts, failed.format_msg())  # type: ignore[no-untyped-call]
        raise SystemExit(1) from failed


def _torchrun(parallel: ParallelSettings, rendezvous: Rendezvous, argv: list[str],
              watch: _ConfigErrorWatch) -> BaseException | None:
    """torchrun's run until the ranks end; again at the rendezvous each time the nodes lost each
    other there (rendezvous.py), at most `max_restarts` times. Returns why the trainer must exit
    with 1 (ChildFailedError, RendezvousFailed), or None."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import parse_args, run

    from tandem_trainer.errors import RendezvousFailed
    from tandem_trainer.rendezvous import lost, what_happened

    gone_back = 0
    while True:
        try:
            rendezvous.reach(parallel.rendezvous_timeout_s)
            run(parse_args(argv))  # type: ignore[no-untyped-call]  # torch leaves torchrun's API untyped
            return None
        except SignalException as exc:
            if watch.message is None:
                log.info("trainer.stopped %s; every rank has stopped", exc)
            return None
        except (ChildFailedError, RendezvousFailed) as exc:
            return exc
        except RendezvousTimeoutError:
            return RendezvousFailed(f"the other nodes did not come to the rendezvous at {rendezvous.endpoint} "
                                    f"within parallel.rendezvous_timeout_s={parallel.rendezvous_timeout_s}s")
        except Exception as exc:
            if not lost(exc):
                raise
            if gone_back == parallel.max_restarts:
                return RendezvousFailed(f"the nodes lost each other at the rendezvous at {rendezvous.endpoint} "
                                        f"once more than parallel.max_restarts={parallel.max_restarts} allows "
                                        f"(the last time: {what_happened(exc)})")
            gone_back += 1
            log.warning("trainer.rendezvous_lost endpoint=%s: %s; this node goes back to the rendezvous and waits "
                        "up to %ds for the other nodes (%d of parallel.max_restarts=%d)", rendezvous.endpoint,
                        what_happened(exc), parallel.rendezvous_timeout_s, gone_back, parallel.max_restarts)
            rendezvous.renew()
