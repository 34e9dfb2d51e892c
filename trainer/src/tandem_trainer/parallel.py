"""Data-parallel training: the ranks torchrun starts, and what they say to each other.

With more than one rank (`parallel.ranks`, or several `gpus.trainer` in split mode)
`tandem-trainer` hands itself to torchrun (main.py), which starts one trainer process
per rank on this machine, before any of them loads a model, and starts them all again when
one fails. Rank 0 is the worker the rest of the trainer knows: it takes jobs from rq, checks
them, locks the run, publishes and writes the state. The other ranks hold the same model and
follow rank 0's orders (step.py):

- `step`: a job's samples and where to resume from. Every rank packs the same micro-batches
  and trains its share (`share`, balanced by padded tokens); then the ranks compare notes
  (`settle`): when any rank failed, every rank raises `RankFailed` naming it; else the LoRA
  gradients are summed across the ranks (`all_reduce`) and every rank takes the same optimizer
  step, so the adapters stay equal without sending weights;
- `published` and `invalidate`: how the job ended, so that each rank knows which version it holds;
- `forget_run`: a run was deleted, so each rank forgets what it holds of it;
- `stop`: rank 0's worker is shutting down.

Orders and notes travel as JSON over a gloo group (nothing is unpickled), gradients over the
default group: NCCL when each rank has its own GPU, gloo on the CPU. On one machine gloo and
NCCL bind to loopback (`GLOO_SOCKET_IFNAME=lo`); with several nodes (launcher.py) they take the
interface of the host name, and rank 0 may be on any node. A rank that dies breaks
the group: the next collective of the others fails at once (gloo sees the closed connection),
rank 0 fails the job in flight with `RanksLost`, and every rank exits, so that torchrun starts
the group again; a job's retry then runs on the new group.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.settings import TrainerSettings
from tandem_trainer.errors import RankFailed, RanksLost

log = logging.getLogger(__name__)

#: How long a rank waits for rank 0's next order: as long as the worker idles.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class Group:
    """This rank's view of the trainer's ranks."""

    rank: int
    world: int
    local_rank: int
    device_index: int | None
    """The CUDA device this rank trains on; None on the CPU."""
    orders: Any = field(repr=False)
    """The gloo group that carries orders and notes."""
    broken: bool = False
    """A collective failed: the ranks can no longer be trusted to agree; this rank must exit."""

    @classmethod
    def start(cls, settings: TrainerSettings, device: str) -> Group:
        """Join the process group torchrun set up (env:// rendezvous); `device` is cpu or cuda."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        timeout = timedelta(seconds=settings.job_timeout_s)
        index = None
        backend = "gloo"
        if device == "cuda":
            count = torch.cuda.device_count()
            index = local_rank % count
            if count >= world:
                backend = "nccl"
            else:  # a test on fewer GPUs than ranks: NCCL refuses two ranks on one GPU
                log.warning("parallel: %d ranks on %d visible GPU(s); ranks share GPUs and the gradients "
                            "go over gloo (slow: for tests, not for training)", world, count)
            torch.cuda.set_device(index)
        store = _attempt_store(rank, world)
        if backend == "nccl" and index is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                    device_id=torch.device("cuda", index))
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        orders = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        log.info("parallel.start rank=%d world=%d local_rank=%d device=%s gradients=%s",
                 rank, world, local_rank, "cpu" if index is None else f"cuda:{index}", backend)
        return cls(rank=rank, world=world, local_rank=local_rank, device_index=index, orders=orders)

    # orders: rank 0 -> the others ----------------------------------------------
    def send(self, kind: str, **body: Any) -> None:
        """Rank 0: broadcast an order to the other ranks."""
        assert self.rank == 0, "only rank 0 gives orders"
        with self._collective(f"sending the {kind!r} order"):
            self._broadcast(json.dumps({"kind": kind, **body}).encode())

    def receive(self) -> dict[str, Any]:
        """Ranks > 0: wait for rank 0's next order."""
        with self._collective("waiting for rank 0's next order"):
            message: dict[str, Any] = json.loads(self._broadcast(None))
        return message

    def _broadcast(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.orders)
        if data is not None:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.orders)
        return buffer.numpy().tobytes()

    # the step -------------------------------------------------------------------
    def share(self, costs: Sequence[int]) -> list[int]:
        """Indices of the micro-batches this rank trains: the largest first, each to the rank with
        the least so far (ties to the lower rank), so every rank computes the same split."""
        loads = [0] * self.world
        mine = []
        for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
            rank = min(range(self.world), key=lambda r: (loads[r], r))
            loads[rank] += costs[i]
            if rank == self.rank:
                mine.append(i)
        return sorted(mine)

    def settle(self, error: str | None, sums: dict[str, float]) -> dict[str, float]:
        """Every rank's outcome of its share: the sums of all ranks, or RankFailed on every rank
        when one of them failed (naming each that did)."""
        note = json.dumps({"error": error, "sums": sums}).encode()
        with self._collective("comparing the ranks' shares of the step"):
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(sizes, torch.tensor([len(note)], dtype=torch.int64), group=self.orders)
            width = max(int(s.item()) for s in sizes)
            padded = torch.zeros(width, dtype=torch.uint8)
            padded[: len(note)] = torch.frombuffer(bytearray(note), dtype=torch.uint8)
            gathered = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(gathered, padded, group=self.orders)
        notes = [json.loads(g[: int(s.item())].numpy().tobytes()) for g, s in zip(gathered, sizes, strict=True)]
        failed = [(r, n["error"]) for r, n in enumerate(notes) if n["error"] is not None]
        if failed:
            raise RankFailed("; ".join(f"rank {r} of {self.world}: {message}" for r, message in failed))
        total: dict[str, float] = {}
        for n in notes:
            for key, value in n["sums"].items():
                total[key] = total.get(key, 0.0) + value
        return total

    def all_reduce(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum the parameters' gradients across the ranks, in one float32 buffer (a rank that
        trained no micro-batch adds zeros). LoRA gradients are small; summing them in float32
        loses nothing to bfloat16 rounding and works on every collective backend."""
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        with self._collective("summing the gradients"):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).to(p.dtype)
            offset += n

    # lifetime ------------------------------------------------------------------
    def stop(self) -> None:
        """Rank 0: tell the other ranks to exit (nothing to tell when the group is broken)."""
        if self.rank == 0 and not self.broken:
            try:
                self.send("stop")
            except RanksLost:
                pass

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        if self.broken:
            raise RanksLost(f"rank {self.rank} of {self.world}: the ranks lost each other earlier; "
                            "torchrun starts them again")
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            self.broken = True
            raise RanksLost(
                f"rank {self.rank} of {self.world} lost the other ranks while {what} ({exc}); a rank "
                "stopped (its log says why) and torchrun starts every rank again"
            ) from exc


def _attempt_store(rank: int, world: int) -> dist.Store:  # type: ignore[name-defined]  # torch's stubs hide it
    """The ranks' store of this start, hosted by rank 0 on the port torchrun chose for it, listening
    on its node's address only (a TCPStore server given no socket of its own listens on every
    interface: rendezvous.py). Each start of the ranks has a store of its own (launcher.py), and
    its keys a prefix of their own (`start_key`): ranks reading the addresses a previous start
    wrote would fail to connect (pytorch#167288)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        from tandem_trainer.rendezvous import listener, store_server

        store = store_server(listener(addr, port), world=world)
    else:
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timedelta(seconds=300))  # type: ignore[attr-defined]
    return dist.PrefixStore(f"tandem/start-{start_key()}", store)  # type: ignore[attr-defined]


def start_key() -> str:
    """A name of this start of the ranks that every rank reads alike from its environment: the
    address of its store, new at every start. torchrun's restart count cannot be it: with several
    nodes the counts differ (a node whose rank did not fail restarts without counting)."""
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
