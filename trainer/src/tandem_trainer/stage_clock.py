"""Where a step's time goes: the wall time of each stage, synchronised with the device when asked.

A step queues work on the GPU and moves on, so a stage's wall time says little unless the
device is waited for at its edges. With `backend.step_breakdown` on, each stage starts and ends
with a synchronise of the device and the totals go into the version's metrics as
`stage_<name>_s` (and `stage_<name>_n`, how often it ran): the order to the other ranks,
packing, activating the parent, forward and backward of each micro-batch, the ranks' settle
round-trip, the gradient all-reduce, the optimizer step, staging the adapter. The synchronises
cost time of their own (the device idles while the host queues the next stage), so the
breakdown is for measuring (bench/gpu/gpu_ddp.py), not for training; off, the clock does nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StageClock:
    """Totals of wall time per stage of one step."""

    synchronize: Callable[[], None] | None = None
    """Waits for the device; None: the clock is off and records nothing."""
    totals: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def on(self) -> bool:
        return self.synchronize is not None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.synchronize is None:
            yield
            return
        self.synchronize()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        """Record `seconds` of stage `name` (timed elsewhere)."""
        if self.synchronize is None:
            return
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + 1

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, seconds in self.totals.items():
            out[f"stage_{name}_s"] = seconds
            out[f"stage_{name}_n"] = float(self.counts[name])
        return out
