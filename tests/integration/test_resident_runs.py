"""Resident runs on the tiny model with a real Redis: a switch back to a run kept in memory trains
what a switch through the store trains, reads nothing from the store, and reads it again once the
store's truth is another."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.jobs import make_job
from helpers.store_reads import counted_reads
from safetensors.torch import load_file

from tandem.adapters import AdapterStore
from tandem.registry import Registry
from tandem.runs import LoraConfig, OptimizerConfig, RunSpec
from tandem.settings import TrainerSettings
from tandem_trainer.backends.peft import PeftBackend
from tandem_trainer.backends.resident import ResidentBudget
from tandem_trainer.jobs.runner import Trainer

pytestmark = pytest.mark.integration

DEVICE = os.environ.get("TANDEM_TEST_TRAINER_DEVICE", "cpu")


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> TrainerSettings:
    (tmp_path / "adapters").mkdir()
    return TrainerSettings(redis={"url": redis_url}, store={"root": tmp_path / "adapters"},
                           backend={"micro_batch_tokens": 128})


def create_runs(conn, tiny_model: Path, *names: str) -> dict[str, RunSpec]:  # type: ignore[no-untyped-def]
    registry = Registry(conn)
    return {name: registry.create_run(RunSpec(name=name, base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0),
                                              optimizer=OptimizerConfig(lr=1e-2), seed=seed, max_staleness_steps=8))
            for seed, name in enumerate(names)}


def train(trainer: Trainer, run: str, step: int) -> int:
    return trainer.train(make_job(f"{run}-{step}", run=run, step=step, seed=step)).version


def state(store: AdapterStore, run: str, version: int) -> tuple[dict[str, torch.Tensor], dict]:  # type: ignore[type-arg]
    vdir = store.version_dir(run, version)
    weights = load_file(str(vdir / "adapter" / "adapter_model.safetensors"))
    optimizer = torch.load(vdir / "trainer" / "optimizer.pt", weights_only=True, map_location="cpu")
    return weights, optimizer["state"]


ORDER = ["a", "b", "a", "b", "a"]


def trained(settings, conn, tiny_model: Path, root: Path, device: str,  # type: ignore[no-untyped-def]
            budget: ResidentBudget) -> tuple[dict, dict[str, int]]:  # type: ignore[type-arg]
    """A, B, A, B, A from fresh runs: each version's published weights and optimizer state, and the
    backend's switches by outcome."""
    conn.flushall()
    create_runs(conn, tiny_model, "a", "b")
    root.mkdir()
    store = AdapterStore(root)
    backend = PeftBackend(device, resident=budget)
    trainer = Trainer(settings, conn, backend, store)
    torch.manual_seed(0)
    steps: Counter[str] = Counter()
    published = {}
    for run in ORDER:
        steps[run] += 1
        version = train(trainer, run, steps[run])
        published[run, version] = state(store, run, version)
    return published, dict(backend.resident_stats().switches)


def assert_same(kept: dict, read: dict, *, exact: bool = True) -> None:  # type: ignore[type-arg]
    """Bit for bit (float32 on the CPU), or within the data-parallel parity tests' tolerance (a GPU's
    kernels may sum in another order from one call to the next)."""
    def same(a: torch.Tensor, b: torch.Tensor, where: tuple) -> None:  # type: ignore[type-arg]
        if exact:
            assert torch.equal(a, b), where
        else:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=str(where))

    assert kept.keys() == read.keys()
    for (run, version), (weights, optimizer) in kept.items():
        read_weights, read_optimizer = read[run, version]
        assert weights.keys() == read_weights.keys()
        for key in weights:
            same(weights[key], read_weights[key], (run, version, key))
        for index, moments in optimizer.items():
            for name, tensor in moments.items():
                same(tensor, read_optimizer[index][name], (run, version, index, name))


def test_a_resident_switch_trains_bit_for_bit_what_the_store_switch_trains(settings, redis_conn, tiny_model,
                                                                           tmp_path: Path) -> None:
    """A, B, A, B, A with the runs kept in memory against the same with every switch through the store."""
    kept, switches = trained(settings, redis_conn, tiny_model, tmp_path / "kept", DEVICE, ResidentBudget())
    assert switches == {"hit": 3, "spill": 0, "miss": 0, "fresh": 2}
    read, switches = trained(settings, redis_conn, tiny_model, tmp_path / "read", DEVICE, ResidentBudget(runs=1))
    assert switches == {"hit": 0, "spill": 0, "miss": 3, "fresh": 2}
    assert_same(kept, read, exact=DEVICE == "cpu")


@pytest.mark.gpu
def test_on_a_gpu_a_run_spilled_to_host_memory_trains_what_the_store_switch_trains(settings, redis_conn, tiny_model,
                                                                                   tmp_path: Path) -> None:
    read, _ = trained(settings, redis_conn, tiny_model, tmp_path / "read", "cuda", ResidentBudget(runs=1))
    kept, switches = trained(settings, redis_conn, tiny_model, tmp_path / "kept", "cuda", ResidentBudget())
    assert switches == {"hit": 3, "spill": 0, "miss": 0, "fresh": 2}  # a fifth of the GPU's free memory holds them
    assert_same(kept, read, exact=False)
    spilled, switches = trained(settings, redis_conn, tiny_model, tmp_path / "spilled", "cuda",
                                ResidentBudget(device_bytes=0))  # as in shared mode: every run set aside spills
    assert switches == {"hit": 0, "spill": 3, "miss": 0, "fresh": 2}
    assert_same(spilled, read, exact=False)


def test_a_switch_to_a_resident_run_reads_nothing_from_the_store(settings, redis_conn, tiny_model,
                                                                 monkeypatch, caplog) -> None:
    create_runs(redis_conn, tiny_model, "a", "b", "c")
    store = AdapterStore(settings.store.root)
    backend = PeftBackend(DEVICE, resident=ResidentBudget(runs=3))  # the training run and two set aside
    trainer = Trainer(settings, redis_conn, backend, store)
    caplog.set_level("INFO", logger="tandem_trainer.backends")
    for run in ("a", "b", "c"):
        train(trainer, run, 1)
    assert backend.holds("a", 1, store.version_dir("a", 1)) and backend.active == ("c", 1)

    with counted_reads(monkeypatch, store) as reads:
        caplog.clear()
        assert train(trainer, "a", 2) == 2  # resident: a copy in memory, not a read
        assert reads == {} and "run=a version=1 loaded=True resident=hit" in caplog.text
        assert train(trainer, "b", 2) == 2
        assert reads == {}

    stats = backend.resident_stats()
    assert stats.runs == {"device": 0, "host": 2} and stats.nbytes["host"] > 0  # the CPU's one tier
    train(trainer, "c", 2)  # still resident: a and b were trained after it
    with counted_reads(monkeypatch, store) as reads:
        Registry(redis_conn).create_run(RunSpec(name="d", base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0)))
        train(trainer, "d", 1)  # a fourth run: the least recently trained (a) is evicted
        assert backend.resident_stats().evicted == 1 and not backend.holds("a", 2, store.version_dir("a", 2))
        caplog.clear()
        train(trainer, "a", 3)  # ...so switching back to it reads its version, as without resident runs
        assert reads == {"verify": 1, "weights": 1, "optimizer": 1}
        assert "run=a version=2 loaded=True resident=miss" in caplog.text


def test_a_resident_run_is_read_again_when_the_store_says_otherwise(settings, redis_conn, tiny_model, monkeypatch,
                                                                    caplog) -> None:
    """A newer version from another trainer, a version's files replaced, invalidate(), another spec."""
    specs = create_runs(redis_conn, tiny_model, "a", "b")
    store = AdapterStore(settings.store.root)
    backend = PeftBackend(DEVICE)
    trainer = Trainer(settings, redis_conn, backend, store)
    train(trainer, "a", 1)
    train(trainer, "b", 1)  # a@v1 is set aside

    other = Trainer(settings, redis_conn, PeftBackend(DEVICE), store, owner="other-trainer")
    assert train(other, "a", 2) == 2  # another trainer publishes a@v2
    with counted_reads(monkeypatch, store) as reads:
        assert trainer.train(make_job("a-3", run="a", step=3, seed=3)).parent == 2  # not a@v1 from memory
        assert reads == {"verify": 1, "weights": 1, "optimizer": 1}
    train(trainer, "b", 2)  # a@v3 set aside

    manifest = store.version_dir("a", 3) / "manifest.json"
    manifest.write_text(manifest.read_text())  # the same version's files written again (a new stamp)
    assert not backend.holds("a", 3, store.version_dir("a", 3))
    with counted_reads(monkeypatch, store) as reads:
        train(trainer, "a", 4)
        assert reads == {"verify": 1, "weights": 1, "optimizer": 1}
    train(trainer, "b", 3)  # a@v4 set aside

    backend.invalidate()  # what rank 0 orders on every rank after a failed job
    assert not backend.holds("a", 4, store.version_dir("a", 4)) and backend.resident_stats().runs["host"] == 0
    with counted_reads(monkeypatch, store) as reads:
        train(trainer, "a", 5)
        assert reads == {"verify": 1, "weights": 1, "optimizer": 1}
    train(trainer, "b", 4)  # a@v5 set aside

    changed = specs["a"].model_copy(update={"optimizer": OptimizerConfig(lr=2e-2)})
    with counted_reads(monkeypatch, store) as reads:
        caplog.set_level("INFO", logger="tandem_trainer.backends")
        backend.activate(changed, 5, store.version_dir("a", 5))  # the run's spec changed: its files, not memory
        assert reads == {"weights": 1, "optimizer": 1} and "resident=miss" in caplog.text
