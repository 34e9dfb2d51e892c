"""Resident runs: the LoRA weights and optimizer state of recently trained runs, kept in memory.

Many runs train on one base model, one at a time: the run training now has its LoRA layers on
the model and its optimizer (the backend's). When a job of another run comes, the backend sets
the training run's state aside here instead of dropping it, so that a later switch back to it
is a pointer swap (its tensors are still on the device) or one copy from pinned host memory,
and reads nothing from the store.

An entry (`ResidentRun`) is one run's state at one published version, as training left it:
its parameters in the dtype they train in (float32: the version's master weights), its
optimizer's state dict and, for jobs that accumulate gradients across calls (the Tinker
`forward_backward` kind), the gradients not yet applied (`gradients`) and the jobs they came from
(`gradient_jobs`). Version 0 (a fresh adapter, no files) is set aside only while it holds
gradients; its stamp is `FRESH`. It is keyed by what the store holds (the run, the
version, the run's spec and the version's directory) and stamped with the version's manifest
(inode, mtime, size: one stat, no read) as of when memory was known to equal the files. It is
used only for exactly that key while the stamp still holds, so a version published by another
trainer, a spec that changed, another store or a version directory replaced or deleted is a
miss, read from the store as before.

Where entries live: the least recently trained ones go first. On CUDA an entry stays on the
device while the entries there fit in `device_bytes`, then is spilled to pinned host memory,
which holds what fits in `host_bytes`; on the CPU there is one tier, host memory. `runs` bounds
the count (the training run included). Past the bounds the least recent entry is evicted.
`ResidentBudget` says how each bound is derived when it is not set.

Eviction writes nothing, because an entry never holds what a later job needs and the store
lacks: it equals a published version, whose weights are in the store and whose optimizer
state jobs/versions.py saves right after publishing, before the job ends. Two things the store
may lack: the optimizer state of a version whose state could not be saved (evicting such an
entry says so: resuming the run starts its optimizer fresh, as resuming from the store would),
and accumulated gradients (`ResidentRun.unsaved`): such an entry is never evicted to make room
(the cache goes over its bound and says so) and dropping it (`clear`, a stale key) says it lost
them. `clear()` drops every entry: the backend's `invalidate`, which rank 0 orders on every
data-parallel rank after a failed job, and a change of base model. `forget(run)` drops a
deleted run's entry, its held gradients with it (the backend's `forget_run`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from tandem.adapters import MANIFEST, TRAINER_DIR
from tandem_trainer.backends.base import OPTIMIZER_STATE

log = logging.getLogger(__name__)

#: Share of the GPU's free memory that entries may hold there when `device_bytes` is unset.
DEVICE_SHARE = 0.2
#: Share of the host's available memory that entries may hold there when `host_bytes` is unset.
HOST_SHARE = 0.2
#: `runs` when unset on the CPU (on CUDA the bytes bound the count).
CPU_RUNS = 4

Key = tuple[str, int, str, str]
"""(run, version, the run's spec as JSON, the version's directory)."""
Stamp = tuple[int, int, int]
"""The version manifest's (inode, mtime in ns, size)."""
Outcome = Literal["hit", "spill", "miss", "fresh"]
"""How a switch found the run: on the device, in host memory (spilled), not resident (read from the
store), or at version 0 (a fresh adapter: nothing to find)."""
OUTCOMES: tuple[Outcome, ...] = ("hit", "spill", "miss", "fresh")
#: The stamp of version 0 (`version_dir` None): a fresh adapter has no files to change.
FRESH: Stamp = (0, 0, 0)


def stamp(version_dir: Path | None) -> Stamp | None:
    """The version's manifest as the file system sees it (one stat); None when it is gone; `FRESH`
    for version 0 (no directory)."""
    if version_dir is None:
        return FRESH
    try:
        st = (version_dir / MANIFEST).stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class ResidentBudget:
    """The bounds (`backend.resident_*` settings); None: derived at the first set-aside."""

    runs: int | None = None
    """Runs kept, the training one included (1: none set aside). Unset: `CPU_RUNS` on the CPU; no
    count of its own on CUDA."""
    device_bytes: int | None = None
    """Unset: `DEVICE_SHARE` of the free memory `torch.cuda.mem_get_info` measures (what neither
    torch's allocator nor another process holds); 0 with a shared GPU, whose free memory is
    inference's, lent for the job."""
    host_bytes: int | None = None
    """Unset: `HOST_SHARE` of the host's available memory (MemAvailable, or the cgroup's limit less
    its usage when lower)."""
    shared_gpu: bool = False


@dataclass
class ResidentRun:
    """One run's state at one published version, set aside (see the module's docstring)."""

    key: Key
    stamp: Stamp
    weights: dict[str, torch.Tensor]
    """The trainable parameters' tensors by parameter name, in the dtype they train in."""
    optimizer: dict[str, Any]
    """The optimizer's `state_dict()`."""
    gradients: dict[str, torch.Tensor] | None = None
    """Gradients accumulated and not yet applied: nothing in the store holds them."""
    gradient_jobs: tuple[str, ...] = ()
    """The jobs whose gradients `gradients` sums, in the order they were accumulated."""
    place: Literal["device", "host"] = "device"
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in _tensors(self._parts()))

    @property
    def unsaved(self) -> str | None:
        """What this entry holds that the store does not, if anything: it must not be evicted."""
        if self.gradients is None and not self.gradient_jobs:
            return None
        return f"accumulated gradients of jobs {list(self.gradient_jobs)}"

    def _parts(self) -> list[Any]:
        return [self.weights, self.optimizer, self.gradients]

    def move(self, to: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.weights, self.optimizer, self.gradients = (_mapped(part, to) for part in self._parts())


@dataclass(frozen=True)
class ResidentStats:
    """The cache at one moment, for /metrics."""

    switches: dict[Outcome, int]
    """Switches by how they found the run."""
    evicted: int
    spilled: int
    runs: dict[str, int]
    """Entries by place (`device`, `host`)."""
    nbytes: dict[str, int]


class ResidentRuns:
    """The runs set aside by one backend, least recently trained first."""

    def __init__(self, device: torch.device, budget: ResidentBudget) -> None:
        self.device, self.budget = device, budget
        self.on_gpu = device.type == "cuda"
        self._entries: OrderedDict[str, ResidentRun] = OrderedDict()
        self._limits: tuple[int | None, int, int] | None = None
        self.switches = dict.fromkeys(OUTCOMES, 0)
        self.evicted = self.spilled = 0
        self._sizes: tuple[dict[str, int], dict[str, int]] = ({}, {})

    @property
    def keeps_any(self) -> bool:
        return self.budget.runs != 1

    def take(self, key: Key, version_dir: Path | None) -> ResidentRun | None:
        """The run's entry, out of the cache, if it holds exactly `key` and its files did not change;
        an entry of the run that does not is dropped."""
        entry = self._entries.pop(key[0], None)
        if entry is not None and (entry.key != key or stamp(version_dir) != entry.stamp):
            why = "its version's files changed" if entry.key == key else "the run wants another version or spec"
            self._dropped(entry, why)
            entry = None
        self._count()
        return entry

    def holds(self, run: str, version: int, version_dir: Path) -> bool:
        """Whether `run` at `version` (in `version_dir`) is set aside and its files did not change."""
        entry = self._entries.get(run)
        return (entry is not None and entry.key[1] == version and entry.key[3] == str(version_dir)
                and stamp(version_dir) == entry.stamp)

    def put(self, entry: ResidentRun) -> None:
        """Set `entry` aside as the most recent; spill and evict what no longer fits."""
        old = self._entries.pop(entry.key[0], None)
        if old is not None:
            self._dropped(old, "a newer state of the run was set aside")
        if not self.on_gpu:
            entry.place = "host"  # the CPU's device is host memory
        self._entries[entry.key[0]] = entry
        runs, device_bytes, host_bytes = self.limits()
        if entry.nbytes > max(device_bytes, host_bytes) and entry.unsaved is None:  # fits nowhere: others stay
            self._forget(entry, f"resident_device_bytes={device_bytes} resident_host_bytes={host_bytes}")
        while runs is not None and len(self._entries) > runs - 1 and self._evict(None, f"resident_runs={runs}"):
            pass
        if self.on_gpu:
            for old in list(self._entries.values()):  # least recent first
                if self._bytes("device") <= device_bytes:
                    break
                if old.place != "device":
                    continue
                if old.nbytes > host_bytes and old.unsaved is None:
                    self._forget(old, f"resident_host_bytes={host_bytes}")
                else:
                    self._spill(old)
        while self._bytes("host") > host_bytes and self._evict("host", f"resident_host_bytes={host_bytes}"):
            pass
        self._count()

    def forget(self, run: str) -> bool:
        """Drop the entry of a deleted run, gradients and all (they belong to no run now); False when
        none is kept. Nothing is written: the run's files go too."""
        entry = self._entries.pop(run, None)
        if entry is not None:
            log.info("resident.forget run=%s version=%d bytes=%d why=the run was deleted%s", run, entry.key[1],
                     entry.nbytes, f" (with its {entry.unsaved})" if entry.unsaved else "")
            self._count()
        return entry is not None

    def clear(self, why: str) -> None:
        for entry in self._entries.values():
            self._dropped(entry, why)
        self._entries.clear()
        self._count()

    def keep(self, key: Key, stamp: Stamp, params: list[tuple[str, torch.nn.Parameter]],
             optimizer: torch.optim.Optimizer, gradient_jobs: tuple[str, ...] = ()) -> None:
        """Set the training run's state aside (`key` and `stamp`: the version it equals), moved out of
        its parameters and optimizer without a copy, its accumulated gradients with it (those are
        kept even when no run is to be kept: `resident_runs=1`)."""
        if self.keeps_any or gradient_jobs:
            weights, state, gradients = set_aside(params, optimizer)
            self.put(ResidentRun(key, stamp, weights, state, gradients, gradient_jobs))

    @staticmethod
    def fits(entry: ResidentRun, params: list[tuple[str, torch.nn.Parameter]]) -> bool:
        """Whether the entry's tensors match the parameters by name, shape and dtype."""
        return entry.weights.keys() == {n for n, _ in params} and all(
            entry.weights[n].shape == p.shape and entry.weights[n].dtype == p.dtype for n, p in params)

    def restore(self, entry: ResidentRun, params: list[tuple[str, torch.nn.Parameter]],
                optimizer: torch.optim.Optimizer) -> Outcome | None:
        """Make the entry's tensors the parameters' and the optimizer's: no copy when the entry is on
        the device (`hit`), one copy each from pinned host memory when it was spilled (`spill`).
        None (nothing changed) when the entry does not fit the parameters."""
        if not self.fits(entry, params):
            self._dropped(entry, "its tensors do not fit the run's LoRA layers")
            return None
        outcome: Outcome = "hit"
        if self.on_gpu and entry.place == "host":
            entry.move(lambda t: t.to(self.device, non_blocking=True) if t.is_pinned() else t)
            torch.cuda.synchronize(self.device)
            entry.place, outcome = "device", "spill"
        for name, p in params:
            p.data = entry.weights[name]
            p.grad = entry.gradients.get(name) if entry.gradients is not None else None
        optimizer.load_state_dict(entry.optimizer)  # keeps tensors already on the parameters' device and dtype
        return outcome

    def stats(self) -> ResidentStats:
        runs, nbytes = self._sizes
        return ResidentStats(switches=dict(self.switches), evicted=self.evicted, spilled=self.spilled,
                             runs=dict(runs), nbytes=dict(nbytes))

    # bounds -----------------------------------------------------------------------
    def limits(self) -> tuple[int | None, int, int]:
        """(runs, device bytes, host bytes), derived once (`ResidentBudget`) and logged."""
        if self._limits is None:
            b = self.budget
            runs = b.runs if b.runs is not None or self.on_gpu else CPU_RUNS
            device = 0
            if self.on_gpu:
                device = b.device_bytes if b.device_bytes is not None else (
                    0 if b.shared_gpu else int(DEVICE_SHARE * torch.cuda.mem_get_info(self.device)[0]))
            host = b.host_bytes if b.host_bytes is not None else int(HOST_SHARE * host_available_bytes())
            self._limits = (runs, device, host)
            log.info("resident.budget runs=%s device_bytes=%d host_bytes=%d (set: runs=%s device_bytes=%s "
                     "host_bytes=%s shared_gpu=%s)", runs, device, host, b.runs, b.device_bytes, b.host_bytes,
                     b.shared_gpu)
        return self._limits

    def _bytes(self, place: str) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.place == place)

    def _spill(self, entry: ResidentRun) -> None:
        t0 = time.perf_counter()
        entry.move(lambda t: _pinned(t) if t.is_cuda else t)
        torch.cuda.synchronize(self.device)
        entry.place = "host"
        self.spilled += 1
        log.info("resident.spill run=%s version=%d bytes=%d copy_ms=%.1f", entry.key[0], entry.key[1],
                 entry.nbytes, (time.perf_counter() - t0) * 1000)

    def _evict(self, place: str | None, bound: str) -> bool:
        """Evict the least recent entry (in `place`) that holds nothing unsaved; False when none may go."""
        for entry in self._entries.values():
            if (place is None or entry.place == place) and entry.unsaved is None:
                self._forget(entry, bound)
                return True
        log.warning("resident.over_bound %s: every entry left holds unsaved state (%s)", bound,
                    ", ".join(f"{e.key[0]}: {e.unsaved}" for e in self._entries.values() if e.unsaved))
        return False

    def _forget(self, entry: ResidentRun, bound: str) -> None:
        """Evict `entry`: nothing is written; the store has its state (said when it lacks the optimizer's)."""
        del self._entries[entry.key[0]]
        self.evicted += 1
        saved = (Path(entry.key[3]) / TRAINER_DIR / OPTIMIZER_STATE).is_file()
        log.log(logging.INFO if saved else logging.WARNING, "resident.evict run=%s version=%d bytes=%d bound=%s%s",
                entry.key[0], entry.key[1], entry.nbytes, bound, "" if saved else ": its optimizer state is not in "
                "the store (saving it failed); resuming the run starts the optimizer fresh")

    def _dropped(self, entry: ResidentRun, why: str) -> None:
        level = logging.WARNING if entry.unsaved else logging.INFO
        log.log(level, "resident.drop run=%s version=%d why=%s%s", entry.key[0], entry.key[1], why,
                f": lost its {entry.unsaved}" if entry.unsaved else "")

    def _count(self) -> None:
        runs = {"device": 0, "host": 0}
        nbytes = {"device": 0, "host": 0}
        for entry in self._entries.values():
            runs[entry.place] += 1
            nbytes[entry.place] += entry.nbytes
        self._sizes = (runs, nbytes)  # one assignment: a scrape's thread reads either the old or the new


# moving a run's state in and out of the model ----------------------------------------
def set_aside(params: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer) -> tuple[
        dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor] | None]:
    """The training run's weights, optimizer state and gradients (None when it has none), moved out
    (no copy).

    Each parameter gets new storage, so that LoRA layers used again for another run (Unsloth's,
    re-initialised in place) never write into what was set aside."""
    weights, gradients = {}, {}
    for name, p in params:
        weights[name] = p.data
        if p.grad is not None:
            gradients[name] = p.grad
            p.grad = None
        p.data = torch.empty_like(p.data)
    return weights, optimizer.state_dict(), gradients or None


def host_available_bytes() -> int:
    """Memory the host can still give: MemAvailable, or the cgroup's limit less its usage when lower."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            log.warning("resident: the host's available memory cannot be read; no run is kept in host memory "
                        "(set TANDEM_BACKEND__RESIDENT_HOST_BYTES)")
            return 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def _pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def _mapped(obj: Any, to: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return to(obj)
    if isinstance(obj, dict):
        return {k: _mapped(v, to) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mapped(v, to) for v in obj]
    return obj
