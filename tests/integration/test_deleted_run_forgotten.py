"""A deleted run is forgotten where it is held beyond Redis and the store: the trainer's memory
(its resident weights, optimizer state and held gradients) and the train queue's fair turns
(`rq:fair:<queue>`), and nothing of another run goes with it.

The trainer is the real one (peft backend on the tiny model, real Redis, real store); the run is
deleted as the gateway deletes it (tandem.deletion, as the inference's Redis user) and its
directory removed as the worker's store cleaner removes it, which tells the trainer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
from helpers.jobs import make_job
from helpers.store_reads import counted_reads

from tandem.acl import Role
from tandem.adapters import AdapterStore
from tandem.deletion import delete_run
from tandem.fair_queue import FairQueue, fair_key
from tandem.jobs import enqueue, train_queue
from tandem.registry import Registry
from tandem.runs import LoraConfig, OptimizerConfig, RunSpec
from tandem.settings import TrainerSettings
from tandem_trainer.backends.peft import PeftBackend
from tandem_trainer.backends.resident import ResidentBudget
from tandem_trainer.jobs.runner import Trainer
from tandem_trainer.store_cleanup import remove_deleted_runs

pytestmark = pytest.mark.integration


def create(conn: redis.Redis, tiny_model: Path, *names: str) -> None:
    for seed, name in enumerate(names):
        Registry(conn).create_run(RunSpec(name=name, base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0),
                                          optimizer=OptimizerConfig(lr=1e-2), seed=seed, max_staleness_steps=8))


def test_the_trainer_forgets_a_deleted_runs_state_and_keeps_the_others(
    redis_url: str, role_conns: dict[Role, redis.Redis], tiny_model: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    trainer_conn = role_conns[Role.TRAINER]
    store = AdapterStore(tmp_path / "adapters")
    store.root.mkdir()
    settings = TrainerSettings(redis={"url": redis_url}, store={"root": store.root}, backend={"micro_batch_tokens": 128})
    create(role_conns[Role.CLIENT], tiny_model, "gone", "kept")
    backend = PeftBackend("cpu", resident=ResidentBudget())
    trainer = Trainer(settings, trainer_conn, backend, store)
    trainer.train(make_job("kept-1", run="kept", step=1, seed=1))
    trainer.train(make_job("gone-1", run="gone", step=1, seed=2))  # gone trains now; kept is set aside
    assert backend.active == ("gone", 1) and backend.holds("kept", 1, store.version_dir("kept", 1))

    delete_run(role_conns[Role.INFERENCE], "gone")
    assert remove_deleted_runs(trainer_conn, store, "test-owner", lambda owner: True,
                               on_removed=trainer.run_deleted) == ["gone"]
    with counted_reads(monkeypatch, store) as reads:
        caplog.clear()
        assert trainer.train(make_job("kept-2", run="kept", step=2, seed=3)).version == 2
        assert reads == {}  # kept came back from memory, as before the deletion
        assert "trainer.forget runs=['gone']" in caplog.text
        assert "run=kept version=1 loaded=True resident=hit" in caplog.text
    assert backend.active == ("kept", 2)
    assert backend.resident_stats().runs == {"device": 0, "host": 0}  # gone was not set aside: it was forgotten

    # a run created again under the name starts fresh: nothing of the deleted one's state is met
    create(role_conns[Role.CLIENT], tiny_model, "gone")
    caplog.clear()
    assert trainer.train(make_job("gone-again-1", run="gone", step=1, seed=4)).version == 1
    assert "run=gone version=0 loaded=False resident=fresh" in caplog.text
    assert backend.holds("kept", 2, store.version_dir("kept", 2))  # kept was set aside again, untouched


def test_deleting_a_run_removes_its_fair_turn_entry_and_no_other(
    role_conns: dict[Role, redis.Redis], redis_conn: redis.Redis, tiny_model: Path,
) -> None:
    create(role_conns[Role.CLIENT], tiny_model, "gone", "kept")
    client = role_conns[Role.CLIENT]
    for run in ("gone", "kept", "gone"):
        enqueue(client, make_job(run=run, step=1))
    queue = train_queue(role_conns[Role.TRAINER])
    for _ in range(2):  # the trainer takes a job of each run in its fair turn, and finishes it
        _, taken = FairQueue.lmove(role_conns[Role.TRAINER], queue.key, None)  # type: ignore[misc]
        redis_conn.lrem(queue.intermediate_queue_key, 0, taken)
    fair = fair_key(queue.key)
    before = redis_conn.hgetall(fair)
    assert {b"gone", b"kept", b":clock"} <= set(before)

    removed = delete_run(role_conns[Role.INFERENCE], "gone")
    assert len(removed.jobs) == 1  # its job still queued went with it
    after = redis_conn.hgetall(fair)
    assert b"gone" not in after
    assert after == {k: v for k, v in before.items() if k != b"gone"}  # kept's time and the clock untouched
