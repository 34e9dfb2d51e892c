"""Resident runs (backends/resident.py) on the CPU: the bounds, eviction by recency, what eviction
refuses, the stamps that tell a stale entry, and the swap in and out of a model's parameters."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tandem_trainer.backends.resident import (
    CPU_RUNS,
    ResidentBudget,
    ResidentRun,
    ResidentRuns,
    host_available_bytes,
    stamp,
)
from tandem_trainer.metrics import TrainerMetrics

CPU = torch.device("cpu")


def published(tmp_path: Path, run: str, version: int, *, state: bool = True) -> Path:
    """A version directory as the store leaves it: a manifest, and the optimizer state unless not."""
    vdir = tmp_path / run / f"v{version:06d}"
    (vdir / "trainer").mkdir(parents=True)
    (vdir / "manifest.json").write_text(f'{{"run": "{run}", "version": {version}}}')
    if state:
        (vdir / "trainer" / "optimizer.pt").write_bytes(b"state")
    return vdir


def entry(tmp_path: Path, run: str, version: int = 1, *, numel: int = 8, state: bool = True,
          gradients: bool = False) -> ResidentRun:
    vdir = published(tmp_path, run, version, state=state)
    stamped = stamp(vdir)
    assert stamped is not None
    return ResidentRun((run, version, "{}", str(vdir)), stamped, {"w": torch.zeros(numel)},
                       {"state": {0: {"exp_avg": torch.zeros(numel)}}, "param_groups": []},
                       gradients={"w": torch.zeros(numel)} if gradients else None)


def test_the_least_recently_trained_run_goes_first(tmp_path: Path) -> None:
    cache = ResidentRuns(CPU, ResidentBudget(runs=3))  # the training run and two set aside
    a, b = entry(tmp_path, "a"), entry(tmp_path, "b")
    cache.put(a)
    cache.put(b)
    assert cache.take(a.key, Path(a.key[3])) is a  # a trains again...
    cache.put(entry(tmp_path, "a", 2))  # ...and is set aside at its next version: now the most recent
    cache.put(entry(tmp_path, "c"))
    assert not cache.holds("b", 1, Path(b.key[3]))
    assert cache.holds("a", 2, tmp_path / "a" / "v000002") and cache.holds("c", 1, tmp_path / "c" / "v000001")
    stats = cache.stats()
    assert stats.evicted == 1 and stats.runs == {"device": 0, "host": 2}  # the CPU's one tier: host memory
    assert stats.nbytes["host"] == 2 * a.nbytes == 2 * 2 * 8 * 4  # the weights and one moment, float32


def test_the_host_bytes_bound_evicts_what_does_not_fit(tmp_path: Path) -> None:
    size = entry(tmp_path, "probe").nbytes
    cache = ResidentRuns(CPU, ResidentBudget(runs=100, host_bytes=2 * size))
    for run in ("a", "b", "c"):
        cache.put(entry(tmp_path, run))
    assert [cache.holds(run, 1, tmp_path / run / "v000001") for run in ("a", "b", "c")] == [False, True, True]
    cache.put(entry(tmp_path, "big", numel=1000))  # larger than the whole bound: not kept, the others stay
    assert not cache.holds("big", 1, tmp_path / "big" / "v000001") and cache.stats().runs["host"] == 2


def test_an_entry_is_used_only_for_its_key_and_while_its_files_are_the_same(tmp_path: Path) -> None:
    cache = ResidentRuns(CPU, ResidentBudget())
    a = entry(tmp_path, "a")
    vdir = Path(a.key[3])
    for other in (("a", 2, "{}", a.key[3]), ("a", 1, '{"lr": 2}', a.key[3]), ("a", 1, "{}", str(tmp_path))):
        cache.put(a)
        assert cache.take(other, vdir) is None and not cache.holds("a", 1, vdir)  # and it is gone
    cache.put(a)
    (vdir / "manifest.json").write_text((vdir / "manifest.json").read_text())  # written again
    assert not cache.holds("a", 1, vdir) and cache.take(a.key, vdir) is None
    cache.put(entry(tmp_path, "b"))
    cache.clear("invalidated")
    assert cache.stats().runs == {"device": 0, "host": 0}


def test_eviction_says_when_the_store_lacks_the_optimizer_state(tmp_path: Path, caplog) -> None:
    cache = ResidentRuns(CPU, ResidentBudget(runs=2))
    cache.put(entry(tmp_path, "saved"))
    cache.put(entry(tmp_path, "unsaved", state=False))  # the version's state could not be written
    with caplog.at_level(logging.INFO, logger="tandem_trainer.backends.resident"):
        cache.put(entry(tmp_path, "c"))
    assert "resident.evict run=unsaved version=1" in caplog.text and "optimizer state is not in the store" in caplog.text


def test_accumulated_gradients_are_never_evicted_and_their_loss_is_said(tmp_path: Path, caplog) -> None:
    cache = ResidentRuns(CPU, ResidentBudget(runs=2))
    cache.put(entry(tmp_path, "pending", gradients=True))
    assert cache.stats().runs["host"] == 1
    cache.put(entry(tmp_path, "b"))  # past the bound: b goes, not the run whose gradients nothing else holds
    assert cache.holds("pending", 1, tmp_path / "pending" / "v000001") and not cache.holds("b", 1, tmp_path / "b" / "v000001")
    with caplog.at_level(logging.WARNING, logger="tandem_trainer.backends.resident"):
        cache.put(entry(tmp_path, "also", gradients=True))
        assert "resident.over_bound resident_runs=2" in caplog.text and cache.stats().runs["host"] == 2
        cache.clear("the backend was invalidated")
    assert "resident.drop run=pending version=1 why=the backend was invalidated: lost its accumulated gradients" in (
        caplog.text)


def test_the_bounds_are_derived_on_the_cpu() -> None:
    assert host_available_bytes() > 0
    runs, device_bytes, host_bytes = ResidentRuns(CPU, ResidentBudget()).limits()
    assert (runs, device_bytes) == (CPU_RUNS, 0) and 0 < host_bytes < host_available_bytes()
    assert ResidentRuns(CPU, ResidentBudget(runs=7, host_bytes=5)).limits() == (7, 0, 5)
    assert not ResidentRuns(CPU, ResidentBudget(runs=1)).keeps_any


def test_a_run_is_swapped_out_of_and_into_the_parameters_without_a_copy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    params = list(layer.named_parameters())
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    trained = {n: p.detach().clone() for n, p in params}
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in params}
    storage = {n: p.data_ptr() for n, p in params}
    vdir = published(tmp_path, "a", 1)
    cache = ResidentRuns(CPU, ResidentBudget())
    stamped = stamp(vdir)
    assert stamped is not None
    key = ("a", 1, "{}", str(vdir))
    cache.keep(key, stamped, params, optimizer)
    assert all(p.data_ptr() != storage[n] for n, p in params)  # the layer was given new storage

    fresh = torch.nn.Linear(4, 3)  # another run's layer, then the run's again (as peft wraps fresh layers)
    again = list(fresh.named_parameters())
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    kept = cache.take(key, vdir)
    assert kept is not None and cache.restore(kept, again, optimizer) == "hit"
    for n, p in again:
        assert p.data_ptr() == storage[n] and torch.equal(p, trained[n])  # the same tensors: no copy
        assert torch.equal(optimizer.state[p]["exp_avg"], moments[n])
    other = ResidentRun(key, stamped, {"weight": torch.zeros(2, 2)}, {})
    assert cache.restore(other, again, optimizer) is None  # does not fit these layers: read the store instead


def test_the_metrics_read_the_resident_runs(tmp_path: Path) -> None:
    cache = ResidentRuns(CPU, ResidentBudget(runs=2))
    metrics = TrainerMetrics()
    assert metrics.registry.get_sample_value("tandem_trainer_resident_switches_total", {"outcome": "hit"}) is None
    metrics.watch_resident(cache.stats)
    cache.switches["hit"] += 2
    cache.switches["miss"] += 1
    for run in ("a", "b"):
        cache.put(entry(tmp_path, run))
    value = metrics.registry.get_sample_value
    assert value("tandem_trainer_resident_switches_total", {"outcome": "hit"}) == 2
    assert value("tandem_trainer_resident_switches_total", {"outcome": "miss"}) == 1
    assert value("tandem_trainer_resident_evictions_total") == 1
    assert value("tandem_trainer_resident_runs", {"place": "host"}) == 1
    assert value("tandem_trainer_resident_bytes", {"place": "host"}) == cache.stats().nbytes["host"] > 0


@pytest.mark.parametrize("field", ["resident_runs", "resident_device_bytes", "resident_host_bytes"])
def test_the_bounds_are_bounded(field: str) -> None:
    from pydantic import ValidationError

    from tandem.settings import TrainerBackendSettings

    with pytest.raises(ValidationError):
        TrainerBackendSettings(**{field: -1})
    assert getattr(TrainerBackendSettings(), field) is None


def test_a_deleted_runs_entry_is_forgotten_with_its_gradients_and_no_other(tmp_path: Path) -> None:
    cache = ResidentRuns(CPU, ResidentBudget(runs=4))
    gone, kept = entry(tmp_path, "gone", gradients=True), entry(tmp_path, "kept", gradients=True)
    cache.put(gone)
    cache.put(kept)
    assert cache.forget("gone") and not cache.forget("gone")  # once; then nothing is held of it
    assert not cache.holds("gone", 1, Path(gone.key[3])) and cache.stats().runs["host"] == 1
    assert cache.take(kept.key, Path(kept.key[3])) is kept and kept.gradients is not None
