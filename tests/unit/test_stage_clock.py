"""The step's stage clock: off, it records nothing; on, it waits for the device at each stage's edges."""

from __future__ import annotations

import time

import pytest

from tandem_trainer.stage_clock import StageClock

pytestmark = pytest.mark.unit


def test_an_off_clock_records_nothing() -> None:
    clock = StageClock()
    with clock.stage("pack"):
        time.sleep(0.01)
    clock.add("order", 1.0)
    assert not clock.on and clock.metrics() == {}


def test_an_on_clock_sums_each_stage_and_synchronises_at_both_edges() -> None:
    waits: list[float] = []
    clock = StageClock(lambda: waits.append(time.perf_counter()))
    for _ in range(3):
        with clock.stage("forward_backward"):
            time.sleep(0.01)
    with clock.stage("optimizer"):
        pass
    metrics = clock.metrics()
    assert metrics["stage_forward_backward_n"] == 3.0 and metrics["stage_optimizer_n"] == 1.0
    assert metrics["stage_forward_backward_s"] >= 0.03
    assert len(waits) == 8  # before and after each of the four stages
